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
With ``aggregation="reduce_scatter"`` a sparse bucket's hook starts the split
(an alltoall to the region owners) and keeps ``acc`` staged whole; ``finish()``
reduces each owned region, selects and gathers (``regions``), merges the result,
and only then zeroes in staging what this worker sent and the global selection
kept (what it dropped stays in the residual).
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

import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from .agreement import StepCheck, StepToken, hyperparameter_digest
from .arena import ArenaLayout, zero_
from .assumption import delta
from .clipping import clip_norm_, local_clip_norms
from .density import dense_policy_units, unit_k
from . import regions, selection
from .exchange import (DenseAllreduce, ExchangeConfig, ExchangeStarted, Pending, SparseAllgather,
                       SparseReduceScatter, all_finite, finite_flag)
from .layout import ExchangeUnit
from .options import LAGSOptions
from .profiling import BackwardTimer
from .residual import ResidualMemory
from .state import LAGSState

__all__ = ["EngineContext", "Engine", "Outcome"]


@dataclass
class EngineContext:
    """What every bucketing of one optimizer shares.

    Attributes:
        options: the validated LAGS options.
        config: the collectives' settings (op, scaling, compression, process set, timeout).
        param_groups: the wrapped optimizer's groups (lr, momentum, weight decay are read
            from them once per iteration).
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
    param_groups: list[dict]
    param_order: list[torch.Tensor]
    select: Callable
    watched: list[tuple[str, torch.Tensor, bool]]
    backward_passes_per_step: int = 1
    sparse_as_dense: bool = False
    observers: list = field(default_factory=list)
    sparse_grads: dict = field(default_factory=dict)  # parameter -> sparse_dim of its torch.sparse gradient
    momentum_correction: bool = False   # resolved from the options and the wrapped optimizer
    token: StepToken = field(init=False)
    dense_exchange: DenseAllreduce = field(init=False)

    def __post_init__(self):
        self.token = StepToken(self.config.collectives, self.options.exchange_timeout, self.config.namespace)
        self.dense_exchange = DenseAllreduce(self.config)


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
        layout: where each bucket and parameter lives in the flat buffers.
        state: the LAGS state carried across iterations (k, residuals, iteration).
        timer: hook timestamps and selection times (the planners' measurements).
    """

    def __init__(self, units: list[ExchangeUnit], context: EngineContext, previous: Engine | None = None):
        self.context = context
        self.units = units
        options = context.options
        layout = self.layout = ArenaLayout(units, context.param_order)
        old = previous.state if previous is not None else None
        state = self.state = LAGSState(units=units, layout=layout, warmup_iterations=options.density_warmup,
                                       warmup_start=options.density_warmup_start,
                                       dense_units=frozenset(dense_policy_units(units, options)))
        if old is not None:
            state.residuals = old.residuals.moved_to(layout)
            state.iteration = old.iteration
            # a bucket's members share one param group, so any member's old unit has its lr
            old_unit = {n: unit.name for unit in old.units for n in unit.param_names}
            state.exchange_lr = {unit.name: old.exchange_lr[old_unit[unit.param_names[0]]] for unit in units
                                 if old_unit[unit.param_names[0]] in old.exchange_lr}
            if old.velocities is not None:
                state.velocities = old.velocities.moved_to(layout)
        elif context.momentum_correction:
            state.velocities = ResidualMemory(layout)
        if state.velocities is not None:
            for unit in units:
                if unit.name not in state.velocities:
                    state.velocities.register(unit.name)
        state.set_plan(unit_k(options, units))
        self.timer = BackwardTimer()
        self._local_clip_norm = local_clip_norms(
            {u.name: u.numel for u in units}, options.local_clip, context.config.world,
            averaged=context.config.average) if options.local_clip is not None else {}
        self._split = options.aggregation == "reduce_scatter"
        self._owner_keep = options.owner_keep
        self._regional = options.regional_selection
        self._max_grad_norm = options.max_grad_norm
        self._sparse_exchange = SparseReduceScatter(context.config, context.select) if self._split \
            else SparseAllgather(context.config)
        if old is not None:   # regions of the units that stay as they were
            state.regions = state.regions_of_these_units(old.regions)
        self._unit_of = {p: unit for unit in units for p in unit.params}
        self._grads = layout.allocate()     # the merged gradients: every p.grad is a view of them
        self._grad_views = {p: slot.shaped(self._grads) for p, slot in layout.param_slots.items()}
        self._unit_grads = {name: slot.of(self._grads) for name, slot in layout.unit_slots.items()}
        self._targets: list[torch.Tensor] = []          # _merge_targets(), for the k in _targets_for
        self._targets_for: dict[str, int] | None = None
        # this iteration's transaction, cleared by finish()
        self._passes_left: dict[torch.Tensor, int] = {}
        self._not_ready: dict[str, set] = {}
        self._pending: dict[str, Pending] = {}
        self._sent: dict[str, torch.Tensor] = {}        # reduce_scatter: this rank's selected indices
        self._kept: dict[str, torch.Tensor] = {}        # reduce_scatter: the global selection G
        self._contributed: dict[str, tuple] = {}        # max_grad_norm: (indices, values, applied mask)
        self._summaries: dict[str, list] = {}           # reduce_scatter: every owner's balancing summary
        self._monitored: dict[str, torch.Tensor] = {}   # acc copies on monitored iterations
        self._staged_lr: dict[str, float] = {}          # lr of this iteration's exchanges, until commit
        self._scale: float | None = None                # the grad_scaler's scale this iteration
        self._group_lr: dict[int, float] = {}           # lr_scaled_residual: each group's lr this iteration
        self.reset_pass_counters()

    @property
    def params(self):
        """The parameters this engine exchanges (those with a hook)."""
        return self._unit_of.keys()

    @property
    def in_flight(self) -> int:
        """Exchanges started in this iteration and not yet finished."""
        return len(self._pending)

    def holds(self, p: torch.Tensor, grad: torch.Tensor) -> bool:
        """Whether ``grad`` is ``p``'s view of the gradient buffer (where ``p.grad`` points after a step)."""
        view = self._grad_views.get(p)
        return view is not None and grad.data_ptr() == view.data_ptr() and grad.shape == view.shape

    @property
    def in_flight_units(self) -> list[str]:
        """The units whose exchanges are in flight, by name."""
        return sorted(self._pending)

    @property
    def traffic(self) -> dict[str, tuple[int, int]]:
        """Per sparse unit, (bytes sent to, bytes received from) other ranks in its last exchange."""
        return dict(self._sparse_exchange.traffic)

    @property
    def idle(self) -> bool:
        """No iteration under way: no step check started, nothing in flight."""
        return not self.context.token.started and not self._pending

    def reset_pass_counters(self) -> None:
        passes = self.context.backward_passes_per_step
        self._passes_left = {p: passes for p in self._unit_of}
        self._not_ready = {unit.name: set(unit.params) for unit in self.units}

    # ------------------------------------------------------------------ backward
    def gradient_ready(self, p: torch.Tensor, overlap: bool) -> None:
        """``p``'s gradient is accumulated: launch its bucket if it was the last one awaited
        (``overlap``), or only note the time (the serial baseline launches in ``finish``)."""
        if not self.context.token.started:
            self._start_token(backward=True)
        unit = self._unit_of[p]
        if self._passes_left[p] <= 0:
            raise RuntimeError("gradients were computed more than backward_passes_per_step times "
                               "before step() or synchronize(); increase backward_passes_per_step "
                               "to accumulate gradients locally (or, if a backward pass meant for "
                               "another optimizer reached these parameters, freeze them for it)")
        self._passes_left[p] -= 1
        if self._passes_left[p] > 0:
            return
        waiting = self._not_ready[unit.name]
        waiting.discard(p)
        if not waiting:
            if overlap:
                self._launch(unit)
            else:
                self.timer.unit_ready(unit.name, self.timer.now(), 0.0)

    def _launch(self, unit: ExchangeUnit, from_hook: bool = True) -> None:
        """Select this unit's entries, stage its residual and start its exchange (no waiting).

        Sparse unit: ``acc = eps + g`` is written once into the staging buffer and
        selected (``finish()`` zeroes the sent entries there, the next residual, and the
        unit's range of the gradient buffer for the merge, for all units at once).
        Dense unit: ``g + eps`` is written into the gradient buffer and allreduced in place.
        No value is read to the host: a NaN or Inf reaches the selected values
        (``selection``) and so every rank's merge, where ``finish()`` checks all units at once."""
        timer, state, context = self.timer, self.state, self.context
        ready_at = timer.now()
        scale = self._loss_scale()
        grads = self._member_grads(unit, scale)
        grad = self._unit_grads[unit.name]
        momentum = context.param_groups[unit.group_index]["momentum"] if state.velocities is not None else None
        if state.is_dense(unit):
            if momentum is not None:   # u = m u + g goes out whole and is kept unmasked
                velocity = state.velocities.accumulate(unit.name, grads, grad_scale=1.0 / scale,
                                                       residual_scale=momentum)
                torch.mul(velocity, scale, out=grad)
            else:
                self._copy_into_arena(unit, grads)
            if unit.name in state.residuals:
                state.residuals.drain_into(unit.name, grad, scale)
            self._started(unit, grad, None, context.dense_exchange.start(unit.name, grad))
        else:
            if momentum is not None:   # u = m u + g; acc = eps + u
                velocity = state.velocities.accumulate(unit.name, grads, grad_scale=1.0 / scale,
                                                       residual_scale=momentum)
                acc, values, indices = self._accumulate_select(unit, velocity, 1.0, 1.0)
            else:
                acc, values, indices = self._accumulate_select(unit, grads, 1.0 / scale,
                                                               self._residual_rescale(unit))
            if self._monitoring():
                self._monitored[unit.name] = acc * scale
            if self._max_grad_norm is not None:   # unscaled, for the clip's give-back
                self._contributed[unit.name] = (indices, values, None)
            if scale != 1.0:
                values = values * scale
            if self._split:            # what stays in the residual is known in finish()
                self._sent[unit.name] = indices
                boundaries = self._boundaries(unit)
                pending = self._sparse_exchange.start(
                    unit.name, values, indices, unit.numel, boundaries,
                    regions.regional_k(boundaries, self.state.k[unit.name]) if self._regional else None)
            else:                      # the sent entries leave the residual after the merge
                pending = self._sparse_exchange.start(unit.name, values, indices, unit.numel)
            self._started(unit, values, indices, pending)
        if from_hook:
            timer.unit_ready(unit.name, ready_at, timer.now() - ready_at)

    def _accumulate_select(self, unit: ExchangeUnit, grads, grad_scale: float, residual_scale: float):
        """Stage ``acc = residual_scale * eps + grad_scale * g`` and select its top k:
        ``(acc, values, indices)``. ``grads``: the unit's flat gradient or its members'.
        Where ``selection.one_pass`` holds, contiguous gradients at scale 1 under the
        built-in selector take one pass for both (``selection.add_select``); otherwise
        the residual memory accumulates, then the selector selects."""
        residuals, k = self.state.residuals, self.state.k[unit.name]
        if self._regional:   # regional selection: each region's share of k (regions.select_regional)
            acc = residuals.accumulate(unit.name, grads, grad_scale=grad_scale, residual_scale=residual_scale)
            return (acc, *regions.select_regional(acc, k, self._boundaries(unit), self.context.select))
        if (self.context.select is selection.select_sampled and grad_scale == 1.0 == residual_scale
                and selection.one_pass(unit.numel, k, unit.params[0].dtype, unit.params[0].device)):
            parts = [grads] if isinstance(grads, torch.Tensor) else grads
            sizes = [unit.numel] if isinstance(grads, torch.Tensor) else [p.numel() for p in unit.params]
            if all(g is not None and g.is_contiguous() and g.numel() == size for g, size in zip(parts, sizes)):
                eps, acc = residuals.stage(unit.name)
                return (acc, *selection.add_select(acc, eps, [g.view(-1) for g in parts], k))
        acc = residuals.accumulate(unit.name, grads, grad_scale=grad_scale, residual_scale=residual_scale)
        return (acc, *self.context.select(acc, k))

    def _retain(self, name: str, sent: torch.Tensor, masked_velocity: bool, where=None) -> None:
        """Zero ``sent`` (where ``where`` marks) in the staged residual and, with momentum
        correction, in the velocity (momentum-factor masking: what was applied restarts)."""
        self.state.residuals.retain(name, sent, where)
        if masked_velocity:
            self.state.velocities.retain(name, sent, where)

    def _global_k(self, name: str, numel: int) -> int:
        """K: what the region owners keep between them, for the unit's k in force."""
        return regions.global_k(self.state.k[name], numel, self._owner_keep)

    def _boundaries(self, unit: ExchangeUnit) -> list[int]:
        """The unit's regions: balanced ones while they fit the K in force, else equal ones."""
        world, kept = self.context.config.world, self._global_k(unit.name, unit.numel)
        boundaries = self.state.regions.get(unit.name)
        if boundaries is None or not regions.fits(boundaries, unit.numel, world, kept):
            boundaries = regions.equal_boundaries(unit.numel, world, kept)
        return boundaries

    def _started(self, unit: ExchangeUnit, values, indices, pending: Pending) -> None:
        self._pending[unit.name] = pending
        if self.context.observers:
            event = ExchangeStarted(unit.name, unit.numel, values, indices, pending)
            for observe in self.context.observers:
                observe(event)

    def _copy_into_arena(self, unit: ExchangeUnit, grads) -> None:
        """Bring the members' gradients into the unit's range of the gradient buffer, unless a
        ``.grad`` already is its view there (autograd accumulated into it)."""
        for p, g in zip(unit.params, grads):
            view = self._grad_views[p]
            if g is None:
                view.zero_()
            elif g.data_ptr() != view.data_ptr() or g.stride() != view.stride():
                view.copy_(g)

    def _loss_scale(self) -> float:
        """The ``grad_scaler``'s current scale S (1 without one), read once per iteration.
        With the GradScaler's power-of-two scales, dividing and multiplying by S is exact."""
        scaler = self.context.options.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return 1.0
        if self._scale is None:
            self._scale = float(scaler.get_scale())
        return self._scale

    def _member_grads(self, unit: ExchangeUnit, scale: float) -> list[torch.Tensor | None]:
        """The members' gradients (None where a member has none); a ``torch.sparse`` one
        (``nn.Embedding(sparse=True)``) is densified for selection and, unless
        ``sparse_as_dense``, handed back sparse after the exchange (as Horovod does), with a
        one-time warning about the dense buffer it costs.
        Then ``local_clip`` clips the unit's gradient (``lags_hvd.clipping``), and with
        ``momentum_correction`` the weight decay joins it (``g + wd x``, times the loss
        scale, on every member, used here or not), since the wrapped SGD then steps
        without its own."""
        context = self.context
        for p, name in zip(unit.params, unit.param_names):
            if p.grad is not None and p.grad.is_sparse:
                if not context.sparse_as_dense and not context.sparse_grads:
                    warnings.warn(f"lags_hvd: parameter {name!r} has a torch.sparse gradient; it is "
                                  f"densified for top-k selection, which costs a dense buffer of "
                                  f"{p.numel()} entries (pass sparse_as_dense=True to silence this)",
                                  stacklevel=4)
                context.sparse_grads[p] = p.grad.sparse_dim()
                p.grad = p.grad.to_dense()
        if context.options.local_clip is not None:
            clip_norm_([p.grad for p in unit.params if p.grad is not None],
                       self._local_clip_norm[unit.name], scale)
        weight_decay = (context.param_groups[unit.group_index]["weight_decay"]
                        if self.state.velocities is not None else 0.0)
        if weight_decay:
            for p in unit.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.add_(p.detach(), alpha=weight_decay * scale)
        return [p.grad for p in unit.params]

    def _residual_rescale(self, unit: ExchangeUnit) -> float:
        """With ``lr_scaled_residual``: eta_{t-1} / eta_t, which keeps eps in the paper's
        lr-scaled space when the lr changes (eta_t is recorded when the step commits)."""
        if not self.context.options.lr_scaled_residual:
            return 1.0
        lr = self._group_lr.get(unit.group_index)
        if lr is None:   # read once per param group and iteration (a tensor lr: one host read)
            lr = self._group_lr[unit.group_index] = float(self.context.param_groups[unit.group_index]["lr"])
        if not lr > 0:
            raise ValueError(f"lr_scaled_residual needs a positive learning rate, got {lr} "
                             f"for {unit.name!r}")
        self._staged_lr[unit.name] = lr
        previous = self.state.exchange_lr.get(unit.name, lr)
        return previous / lr if previous != lr else 1.0

    def _monitoring(self) -> bool:
        every = self.context.options.monitor_every
        return bool(every) and self.state.iteration % every == 0

    # ------------------------------------------------------------------ synchronize
    def _start_token(self, backward: bool) -> None:
        """Start this iteration's step check. ``fresh``: a backward pass ran on this rank, or
        every gradient is None or zero (a rank with an empty batch, as Horovod allows); a
        rank whose gradients are the last step's merged ones (``step()`` called twice) is not."""
        watched = self.context.watched
        changed = next((i + 1 for i, (_, p, trains) in enumerate(watched) if p.requires_grad != trains), 0)
        fresh = backward or all(p.grad is None or not _nonzero(p.grad) for p in self._unit_of)
        self.context.token.start(self.state.iteration, fresh, self.state.plan_digest, changed, self._loss_scale(),
                                 hyperparameter_digest(self.context.param_groups))

    def finish(self) -> Outcome:
        """Complete the iteration: launch the units whose hooks did not fire (a zero gradient,
        so every rank takes part in every collective), pass the step check, collect, merge,
        commit or discard the staged residuals, and bind every ``p.grad`` to its view."""
        if not self.context.token.started:
            self._start_token(backward=False)
        for unit in self.units:
            if unit.name not in self._pending:
                self._launch(unit, from_hook=False)
        timer, state = self.timer, self.state
        outcome = Outcome(state.iteration, [])
        try:
            zeroing = timer.now()
            self._zero_merge_targets()
            started = timer.now()
            # the step check first: ranks out of step may wait on exchanges of different names
            outcome.joined = self.context.token.check(lambda i: self.context.watched[i][0]).joined
            arrived = self._collect()
            collected = timer.now()
            outcome.nonfinite, merge_shared = self._merge(arrived)
            merge = timer.now() - collected
            wait = collected - started
            if not outcome.nonfinite:
                if self._sent:
                    self._keep_dropped()
                if self._monitored:   # the paper's delta is of the update before any clip
                    outcome.delta = self._measure_delta()
                if self._max_grad_norm is not None:
                    outcome.grad_norm = self._clip_merged()
                state.commit()
                state.exchange_lr.update(self._staged_lr)
            self._bind_grads()
        finally:
            self._end_iteration()
        timer.end_iteration(wait, merge, started - zeroing, merge_shared)
        state.iteration += 1
        return outcome

    def _zero_merge_targets(self) -> None:
        """Every g consumed: the merge adds into zeros (zeroed while the exchanges are in flight)."""
        for target in self._merge_targets():
            zero_(target)

    def _collect(self) -> dict:
        """Wait for every exchange (reduce_scatter: reduce the owned regions and gather first)."""
        if self._sent:
            self._reduce_and_gather()
        return {name: pending.collect() for name, pending in self._pending.items()}

    def _end_iteration(self) -> None:
        """Forget everything of this iteration, whatever happened in it."""
        self._pending.clear()
        self._sent.clear()
        self._kept.clear()
        self._contributed.clear()
        self._summaries.clear()
        self._monitored.clear()
        self.state.discard()   # whatever was not committed
        self._staged_lr.clear()
        self._scale = None
        self._group_lr.clear()
        self.reset_pass_counters()
        self.context.token.forget()   # after an error before the check: no handle is left behind

    # ------------------------------------------------------------------ lags_hvd.join()
    def start_shadow(self) -> None:
        """A rank in ``lags_hvd.join()``: post this iteration's step check, marked joined."""
        self.context.token.start(self.state.iteration, False, 0, 0, 1.0, 0, joined=True)

    @property
    def shadow_ready(self) -> bool:
        """Whether ``start_shadow``'s check has arrived from every rank."""
        return self.context.token.done()

    def shadow(self) -> StepCheck:
        """A rank in ``lags_hvd.join()``, once ``start_shadow``'s check has arrived: while
        some ranks still train, take part in their iteration with a zero contribution to
        every unit, at their k and regions, so their collectives complete (the average
        divides by P all the same). Nothing of this rank's state changes but the regions,
        which follow the owners' as on every rank. Returns the check."""
        check = self.context.token.check(lambda i: self.context.watched[i][0])
        if check.iteration is None:
            return check
        state, own = self.state, self.state.iteration
        state.iteration = check.iteration   # the ranks training: their warm-up's k, their rebalancing
        state.apply_schedule()
        try:
            for unit in self.units:
                self._launch_zero(unit)
            self._zero_merge_targets()
            nonfinite, _ = self._merge(self._collect())
            if not nonfinite:   # as the ranks training go on: their regions, their delta's allreduces
                if self._sent:
                    self._keep_dropped()
                if self._monitored:
                    self._measure_delta()
        finally:
            self._end_iteration()
            state.iteration = own
            state.apply_schedule()
        return check

    def _launch_zero(self, unit: ExchangeUnit) -> None:
        """Start ``unit``'s exchange with nothing in it: k zeros at distinct indices (by
        region, as regional selection sends them), or a dense unit's zeros."""
        if self.state.is_dense(unit):
            grad = self._unit_grads[unit.name].zero_()
            self._pending[unit.name] = self.context.dense_exchange.start(unit.name, grad)
            return
        if self._monitoring():
            self._monitored[unit.name] = torch.zeros(unit.numel, dtype=unit.dtype, device=unit.device)
        k, boundaries = self.state.k[unit.name], self._boundaries(unit) if self._split else None
        shares = regions.regional_k(boundaries, k) if self._regional else None
        indices = (torch.cat([torch.arange(start, start + n) for start, n in zip(boundaries, shares)])
                   if self._regional else torch.arange(k)).to(unit.device)
        values = torch.zeros(indices.numel(), dtype=unit.dtype, device=unit.device)
        if self._split:
            self._sent[unit.name] = indices
            pending = self._sparse_exchange.start(unit.name, values, indices, unit.numel, boundaries, shares)
        else:
            pending = self._sparse_exchange.start(unit.name, values, indices, unit.numel)
        self._pending[unit.name] = pending

    def _reduce_and_gather(self) -> None:
        """reduce_scatter: once every split has arrived, reduce each owned region and start
        the gathers (the second collective of every sparse bucket)."""
        units = {unit.name: unit for unit in self.units}
        for name in self._sent:
            unit = units[name]
            split = self._pending[name].wait()
            boundaries, kept = self._boundaries(unit), self._global_k(name, unit.numel)
            shares = (regions.regional_keep(boundaries, self.state.k[name], kept) if self._regional
                      else regions.region_k(boundaries, kept))
            self._pending[name] = self._sparse_exchange.reduce_and_gather(
                name, split, boundaries, shares, unit.numel,
                regions.rebalancing(self.state.iteration) and not self._regional)

    def _keep_dropped(self) -> None:
        """reduce_scatter's error feedback: zero in staging only what this rank sent and the
        global selection G kept; on a rebalancing iteration, the next regions from the
        owners' summaries (the same on every rank)."""
        momentum = self.state.velocities is not None
        world = self.context.config.world
        for name, sent in self._sent.items():
            applied = torch.isin(sent, self._kept[name])
            self._retain(name, sent, momentum, where=applied)
            if name in self._contributed:
                self._contributed[name] = (*self._contributed[name][:2], applied)
            if self._summaries[name] is not None:
                numel = self.layout.unit_slots[name].numel
                self.state.regions[name] = regions.balanced_boundaries(
                    self._summaries[name], numel, world, self._global_k(name, numel))

    def _clip_merged(self) -> torch.Tensor:
        """``max_grad_norm``: clip the merged gradient, ``grad *= c`` (``clipping.clip_norm_``
        over every arena at once), and stage ``eps += (1 - c) s`` for every entry this rank
        sent and the merge applied, so the clip delays that mass instead of dropping it.
        Returns the norm before the clip (loss scale removed); no host read."""
        norm, factor = clip_norm_(list(self._grads.values()), self._max_grad_norm, self._loss_scale())
        for name, (indices, values, applied) in self._contributed.items():
            self.state.residuals.give_back(name, indices, values, factor, applied)
        return norm

    def _merge(self, arrived: dict) -> tuple[list[str], float]:
        """Write every unit's reduced gradient into the gradient buffer: the sparse units of
        each arena in one ``merge_into``, the dense ones (reduced in place) copied only where
        the wire changed their dtype. Returns the units with a NaN or Inf, found with one
        host read in all (a second only when something is not finite), and the seconds the
        per-arena merges and that read took (once per iteration: the same for any bucketing;
        the rest, each unit's ``finish`` and the dense units' copies, grows with the buckets)."""
        parts: dict = {}
        flags, checks = [], []
        for name, result in arrived.items():
            slot = self.layout.unit_slots[name]
            if self.state.k[name] == slot.numel:
                reduced = self._pending[name].finish(result)
                target = self._unit_grads[name]
                if reduced.data_ptr() != target.data_ptr():
                    target.copy_(reduced)
                flags.append(finite_flag(target))
                checks.append([name])
            else:
                if name in self._sent:                # one row: the global selection G
                    values, indices, self._summaries[name] = self._pending[name].finish(result)
                    self._kept[name] = indices.view(-1)
                    arrival = (values, indices)
                else:                                 # every rank's message, unpacked in the merge
                    arrival = self._pending[name].finish(result)
                parts.setdefault(slot.key, []).append((slot.start, arrival, slot.numel, name))
        shared_started = self.timer.now()
        for key, unit_parts in parts.items():
            merged, sent = self._sparse_exchange.merge_into(self._grads[key], [part[:3] for part in unit_parts])
            if sent is not None:   # eps = acc - s for every unit of the arena at once
                self.state.residuals.retain_positions(key, sent)
                if self.state.velocities is not None:   # momentum-factor masking
                    self.state.velocities.retain_positions(key, sent)
            flags.append(finite_flag(merged))
            checks.append([part[3] for part in unit_parts])
        finite = not flags or bool(torch.stack(flags).all())
        shared = self.timer.now() - shared_started
        if finite:
            return [], shared
        # the rare path: which units, exactly
        return sorted(name for names in checks for name in names if not all_finite(self._unit_grads[name])), shared

    def _merge_targets(self) -> list[torch.Tensor]:
        """The ranges of the gradient buffer the sparse units merge into, neighbours joined
        (one view per run of consecutive sparse units), for the k in force; rebuilt only
        when k changes."""
        if self._targets_for != self.state.k:
            runs = []   # [arena key, start, end]
            slots = sorted(self.layout.unit_slots.items(), key=lambda item: (str(item[1].key), item[1].start))
            for name, slot in slots:
                if self.state.k[name] == slot.numel:
                    continue
                if runs and runs[-1][0] == slot.key and runs[-1][2] == slot.start:
                    runs[-1][2] += slot.numel
                else:
                    runs.append([slot.key, slot.start, slot.start + slot.numel])
            self._targets = [self._grads[key][start:end] for key, start, end in runs]
            self._targets_for = dict(self.state.k)
        return self._targets

    def _bind_grads(self) -> None:
        """Point every ``p.grad`` at its view of the gradient buffer (a ``torch.sparse``
        gradient is handed back sparse)."""
        sparse_grads = self.context.sparse_grads
        for p, view in self._grad_views.items():
            if p in sparse_grads:   # as it came (nn.Embedding: one sparse dimension)
                p.grad = view.to_sparse(sparse_grads[p])
            elif p.grad is not view:
                p.grad = view

    def _measure_delta(self) -> dict[str, float]:
        """delta per sparse unit: the dense average of acc against what was applied."""
        units = {unit.name: unit for unit in self.units}
        averages = {name: self.context.dense_exchange.start(f"monitor.{name}", acc)
                    for name, acc in sorted(self._monitored.items())}
        return {name: delta(pending.wait(), self._unit_grads[name], self.state.k[name], units[name].numel)
                for name, pending in averages.items()}


def _nonzero(grad: torch.Tensor) -> bool:
    return bool((grad._values() if grad.is_sparse else grad).any())
