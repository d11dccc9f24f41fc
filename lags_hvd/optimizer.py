"""``lags_hvd.DistributedOptimizer``: LAGS-SGD as a drop-in for ``hvd.DistributedOptimizer``.

For every exchange unit u (by default one per parameter) on worker p::

    acc_p  = eps_p + g_p                       on the backward hook of u's last member
    s_p    = TopK(acc_p, k_u)                  k_u = max(1, ceil(density_u * d_u))
    start allgather of (s_p values, indices)   asynchronous; backprop goes on
    eps_p' = acc_p - s_p                       staged locally (residual.py)
    ...
    synchronize():  grad_u = (1/P) sum_p s_p   (op=Average; Sum drops 1/P)
                    eps_p = eps_p' if every grad_u is finite, else the step is skipped
    step():         the wrapped optimizer's own update on grad_u

From its hook until ``synchronize()`` returns, a parameter's ``.grad`` belongs to
the optimizer (it holds ``acc``; Horovod's optimizer likewise reduces in place).

A unit of density 1 skips selection and uses Horovod's dense allreduce, so the
whole optimizer at density 1 computes exactly what ``hvd.DistributedOptimizer``
computes.

The wrapper re-classes the user's optimizer instance (its parameters, groups,
hyper-parameters and state are kept, not copied), so learning-rate schedulers,
``GradScaler`` and ``isinstance`` checks keep working.

Ranks agree or fail loudly (``agreement``): the settings are compared on every
rank before any exchange, and every iteration carries a small step check, so a
rank out of step raises ``OutOfStepError`` everywhere instead of being summed
with the others. Every wait is bounded (``exchange_timeout``). Ranks outside the
``process_set`` step on their local gradients, as with Horovod.
"""
from __future__ import annotations

import functools
import math
import sys
import warnings
from contextlib import contextmanager
from typing import Callable

import horovod.torch as hvd
import torch

from . import selection
from .agreement import StepToken, agree_on_settings
from .clipping import clip_norm_, local_clip_norms
from .density import ADAPTIVE, k_for_density
from .assumption import delta
from .adaptive import AdaptiveDensity, AutoBuckets
from .arena import ArenaLayout
from .state import LAGSState
from .exchange import (DEFAULT_TIMEOUT, DenseAllreduce, ExchangeConfig, ExchangeStarted, Pending, SparseAllgather,
                       all_finite, broadcast_object, finite_flag)
from .layout import ExchangeUnit, build_units, name_parameters, small_tensor_groups
from .options import LAGSOptions
from .profiling import BackwardTimer
from .residual import ResidualMemory

__all__ = ["DistributedOptimizer", "TopKDistributedOptimizer", "broadcast_optimizer_state"]

_STATE_KEY = "lags"

HOROVOD_STEP_WARNING = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                        "optimizer.synchronize().")
"""Horovod's own warning sentence, kept verbatim as the start of ours (scripts match it)."""


class _LAGSOptimizer:
    """Mixin placed in front of the wrapped optimizer's class; see ``DistributedOptimizer``."""

    # ------------------------------------------------------------------ set-up
    def _lags_init(self, named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set,
                   lags_options: dict):
        """Validate locally, agree with every rank (one collective), then wire the hooks.

        A rank whose own validation fails still takes part in the agreement, so the others
        raise a clear error instead of waiting for it."""
        if getattr(process_set, "process_set_id", None) is None:
            raise ValueError(f"{process_set} is not registered with Horovod: pass it to hvd.init("
                             "process_sets=[...]) or hvd.add_process_set() on every rank first")
        self._member = included = bool(process_set.included())
        options, settings, error = None, None, None
        try:
            options = LAGSOptions(**lags_options)
            self._configure(options, named_parameters, compression, backward_passes_per_step, op,
                            gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set)
            settings = self._settings(backward_passes_per_step, sparse_as_dense)
        except (ValueError, TypeError) as refused:
            error = refused
        if included:   # non-members exchange nothing, as with Horovod: they step locally
            agree_on_settings(settings, error, process_set,
                              options.exchange_timeout if options else DEFAULT_TIMEOUT)
        elif error is not None:
            raise error
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._make_hook(p))
                              for p in self._unit_of] if included else []

    def _configure(self, options: LAGSOptions, named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set) -> None:
        """Everything that needs no communication: units, k, exchanges; raises on bad input."""
        self._names = names = name_parameters(self.param_groups, named_parameters)
        if sum(map(bool, (num_groups, groups is not None, options.buckets != "layer"))) > 1:
            raise ValueError("pass only one of num_groups, groups and buckets")
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
                or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")
        trainable = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if num_groups:
            ordered = sorted(trainable, key=lambda p: names[p])
            size = math.ceil(len(ordered) / num_groups)
            groups = [ordered[i:i + size] for i in range(0, len(ordered), size)]
        self._options = options
        if isinstance(options.buckets, int):
            kinds = self._param_kinds()
            groups = small_tensor_groups(self.param_groups, options.buckets, kind=kinds.get)
        units = build_units(self.param_groups, names, groups)
        if not units:
            raise ValueError("the optimizer has no trainable parameters to exchange")
        self._config = ExchangeConfig(op=op, gradient_predivide_factor=gradient_predivide_factor,
                                      compression=compression, process_set=process_set,
                                      timeout=options.exchange_timeout)
        self._options = options
        self._process_set = process_set
        if options.momentum_correction:
            self._check_momentum_correction(units)
        self._lags = None
        self._adaptive = None
        self._build(units)
        if options.adaptive and options.buckets != "auto":
            self._start_adaptive()
        self._auto_buckets = AutoBuckets(options, process_set, *self._bucket_kinds()) \
            if options.buckets == "auto" else None
        self._select = selection.get_selector(options.selector, checked=not options.trust_selector)
        self._dense_exchange = DenseAllreduce(self._config)
        self._token = StepToken(process_set, options.exchange_timeout)
        self._sparse_as_dense = sparse_as_dense
        self._sparse_grads: dict[torch.Tensor, int] = {}   # parameters whose gradient came as torch.sparse
        self.backward_passes_per_step = backward_passes_per_step
        self._watched = [(names[p], p, p.requires_grad) for g in self.param_groups for p in g["params"]]
        self._passes_left = {p: backward_passes_per_step for p in self._unit_of}
        self._pending: dict[str, Pending] = {}
        self._monitored: dict[str, torch.Tensor] = {}   # acc copies on monitored iterations
        self._staged_lr: dict[str, float] = {}  # lr of this iteration's exchanges, until commit
        self._scale: float | None = None        # the grad_scaler's scale this iteration
        self._group_lr: dict[int, float] = {}   # lr_scaled_residual: each group's lr this iteration
        self._skip_step = False
        self._failed: str | None = None       # set by an error in a hook or synchronize()
        self.skipped_steps = 0
        self.assumption_log: list[dict] = []
        self._synchronized = False
        self._should_synchronize = True
        self.overlap = True
        self.exchange_observers: list[Callable[[ExchangeStarted], None]] = []

    exchange_observers: list
    """Callables told of every exchange as it starts (``exchange.ExchangeStarted``: the
    unit, this rank's values and indices, the pending handle), in the thread that starts
    it: instrumentation for tests and profilers. Empty by default (nothing is called)."""

    def _build(self, units: list[ExchangeUnit]) -> None:
        """Lay ``units`` out in flat buffers and set their k; on a re-plan, carry the residuals,
        velocities, iteration and lr record of the old units over, parameter by parameter."""
        options, old = self._options, self._lags
        # backprop usually produces gradients in reverse registration order
        layout = ArenaLayout(units, [p for g in reversed(self.param_groups) for p in reversed(g["params"])])
        self._layout = layout
        self._lags = LAGSState(units=units, layout=layout, warmup_iterations=options.density_warmup,
                               warmup_start=options.density_warmup_start,
                               dense_units=frozenset(self._dense_policy_units(units, options)))
        if old is not None:
            self._lags.residuals = old.residuals.moved_to(layout)
            self._lags.iteration = old.iteration
            # a bucket's members share one param group, so any member's old unit has its lr
            old_unit = {n: unit.name for unit in old.units for n in unit.param_names}
            self._lags.exchange_lr = {unit.name: old.exchange_lr[old_unit[unit.param_names[0]]] for unit in units
                                      if old_unit[unit.param_names[0]] in old.exchange_lr}
            if old.velocities is not None:
                self._lags.velocities = old.velocities.moved_to(layout)
        elif options.momentum_correction:
            self._lags.velocities = ResidualMemory(layout)
        if self._lags.velocities is not None:
            for unit in units:
                if unit.name not in self._lags.velocities:
                    self._lags.velocities.register(unit.name)
        densities = {u.name: options.min_density for u in units} if options.adaptive \
            else self._fixed_densities(options, units)
        self._lags.set_plan(_k_for(densities, units))
        self._local_clip_norm = local_clip_norms({u.name: u.numel for u in units}, options.local_clip,
                                                 self._config.world) if options.local_clip is not None else {}
        self._timer = BackwardTimer()
        self._sparse_exchange = SparseAllgather(self._config)
        self._unit_of = {p: unit for unit in units for p in unit.params}
        self._not_ready = {unit.name: set(unit.params) for unit in units}
        self._grads = layout.allocate()     # the merged gradients: every p.grad is a view of them
        self._grad_views = {p: slot.shaped(self._grads) for p, slot in layout.param_slots.items()}
        self._unit_grads = {name: slot.of(self._grads) for name, slot in layout.unit_slots.items()}

    def _start_adaptive(self) -> None:
        self._adaptive = AdaptiveDensity(self._options, self._process_set, self._lags.units,
                                         start=self._lags.iteration)
        self._adaptive.set_floor(self._lags.planned_k)

    def _param_kinds(self) -> dict[torch.Tensor, tuple]:
        """Per trainable parameter, what must agree for parameters to share a bucket: param
        group, dtype, device, density and whether the ``dense_params`` policy sends it whole."""
        options = self._options
        kinds = {}
        for index, group in enumerate(self.param_groups):
            for p in group["params"]:
                name = self._names[p]
                density = options.min_density if options.adaptive else \
                    options.layer_densities.get(name, options.density)
                dense = options.dense_params == "1d" and p.dim() <= 1 and name not in options.layer_densities
                kinds[p] = (index, p.dtype, p.device, 1.0 if dense else density, dense)
        return kinds

    def _bucket_kinds(self) -> tuple[dict[str, tuple], dict[str, float]]:
        """``_param_kinds`` and each parameter's density, by name, for ``AutoBuckets``."""
        kinds = {self._names[p]: kind for p, kind in self._param_kinds().items()}
        return kinds, {name: kind[3] for name, kind in kinds.items()}

    _ENGINE_PARTS = ("_layout", "_lags", "_timer", "_sparse_exchange", "_unit_of", "_not_ready", "_grads",
                     "_grad_views", "_unit_grads", "_local_clip_norm", "_adaptive", "_passes_left")

    def _engine_parts(self) -> dict:
        """What ``_build`` / ``_rebucket`` replace, to put back after a failed load."""
        return {name: getattr(self, name) for name in self._ENGINE_PARTS}

    def _rebucket(self, buckets: list[list[str]]) -> None:
        """Apply a bucket plan (lists of parameter names) on this rank."""
        by_name = {name: p for p, name in self._names.items()}
        units = build_units(self.param_groups, self._names, [[by_name[n] for n in bucket] for bucket in buckets])
        self._build(units)
        self._passes_left = {p: self.backward_passes_per_step for p in self._unit_of}
        if self._options.adaptive:
            self._start_adaptive()

    def _settings(self, backward_passes_per_step, sparse_as_dense) -> dict:
        """What every rank must set alike, for ``agreement.agree_on_settings``."""
        config = self._config
        units = self._lags.units
        return {"model": [(name, tuple(p.shape), str(p.dtype)) for unit in units
                          for name, p in zip(unit.param_names, unit.params)],
                "exchange units": [unit.name for unit in units],
                "k": dict(self._lags.k),
                "options": self._options.shared_settings(),
                "wrapped optimizer": {"class": type(self).__mro__[2].__qualname__, "param groups": [
                    {key: _plain(value) for key, value in group.items() if key != "params"}
                    for group in self.param_groups]},
                "exchange": {"op": str(config.op), "gradient_predivide_factor": config.gradient_predivide_factor,
                             "compression": getattr(config.compression, "__name__", type(config.compression).__name__),
                             "backward_passes_per_step": backward_passes_per_step,
                             "sparse_as_dense": bool(sparse_as_dense)}}

    @staticmethod
    def _dense_policy_units(units, options: LAGSOptions) -> list[str]:
        """Units the ``dense_params`` policy sends whole: all members 1-D, none (nor the unit) named
        in layer_densities."""
        if options.dense_params != "1d":
            return []
        return [u.name for u in units if u.name not in options.layer_densities
                and all(p.dim() <= 1 and n not in options.layer_densities for p, n in zip(u.params, u.param_names))]

    def _check_momentum_correction(self, units) -> None:
        if not isinstance(self, torch.optim.SGD):
            raise ValueError("momentum_correction applies to torch.optim.SGD with momentum; the wrapped "
                             f"optimizer is {type(self).__name__}")
        for unit in units:
            group = self.param_groups[unit.group_index]
            if not group["momentum"] > 0 or group["dampening"] != 0 or group["nesterov"]:
                raise ValueError("momentum_correction needs SGD with momentum > 0, dampening 0 and "
                                 f"nesterov=False; param group {unit.group_index} has momentum "
                                 f"{group['momentum']}, dampening {group['dampening']}, nesterov "
                                 f"{group['nesterov']}")

    @staticmethod
    def _fixed_densities(options: LAGSOptions, units) -> dict[str, float]:
        """Each unit's density: ``layer_densities`` by the unit's name or, for a bucket that
        ``buckets`` merged, its first parameter's (merged parameters share one density)."""
        layer = options.layer_densities
        unknown = sorted(set(layer) - {u.name for u in units} - {n for u in units for n in u.param_names})
        if unknown:
            raise ValueError(f"layer_densities names no exchange unit: {unknown}")
        return {u.name: layer.get(u.name, layer.get(u.param_names[0], options.density)) for u in units}

    @property
    def lags_state(self) -> LAGSState:
        """The LAGS-SGD state object (units, k per unit, residuals)."""
        return self._lags

    @property
    def plan(self):
        """The adaptive plan in force (``planner.UnitPlan`` per unit), or None."""
        return self._adaptive.plan if self._adaptive else None

    @property
    def adaptive_settled(self) -> bool:
        """Adaptive mode: a plan has been verified (or the loop fell back); fixed mode: True."""
        return self._adaptive.settled if self._adaptive else True

    @property
    def buckets_settled(self) -> bool:
        """``buckets="auto"``: the buckets have been planned; otherwise True."""
        return self._auto_buckets is None or self._auto_buckets.planned

    @property
    def bucket_history(self) -> list[dict]:
        """``buckets="auto"``'s decision (iteration, buckets, fitted engine costs, predicted
        times of per-layer, one bucket and the chosen plan), identical on every rank."""
        return self._auto_buckets.history if self._auto_buckets else []

    @property
    def adaptive_history(self) -> list[dict]:
        """The adaptive loop's decisions (plan, keep, back off), identical on every rank."""
        return self._adaptive.history if self._adaptive else []

    overlap: bool
    """True (default): each unit's exchange starts from its backward hook, overlapping the
    rest of backprop. False: hooks only take note, and ``synchronize()`` starts every
    exchange after backprop (the same messages without pipelining; a baseline)."""

    @property
    def exchanges_in_flight(self) -> int:
        """Exchanges started by this iteration's hooks and not yet synchronized."""
        return len(self._pending)

    @property
    def backward_timer(self) -> BackwardTimer:
        """Hook timestamps and selection times of recent iterations."""
        return self._timer

    # ------------------------------------------------------------------ backward hooks
    def _make_hook(self, p):
        def hook(_param):
            self._on_grad_ready(p)
        return hook

    def _on_grad_ready(self, p) -> None:
        self._check_usable()
        try:
            self._gradient_ready(p)
        except BaseException as error:
            self._fail(error)
            raise

    def _check_usable(self) -> None:
        if self._failed:
            raise RuntimeError(
                f"lags_hvd: this optimizer failed at iteration {self._lags.iteration} ({self._failed}). That "
                "iteration's gradients already hold residuals and its exchanges cannot be completed, so it "
                "cannot go on: stop this process and restart from the last checkpoint (the residuals in "
                "state_dict() are still those of the last completed step)")

    def _fail(self, error: BaseException) -> None:
        """Mark the optimizer unusable after an error in a hook or in synchronize(): going on
        would add the residuals to gradients that already hold them."""
        self._failed = f"{type(error).__name__}: {str(error)[:200]}"

    def _gradient_ready(self, p) -> None:
        if not self._token.started:
            self._start_token(backward=True)
        unit = self._unit_of[p]
        if self._passes_left[p] <= 0:
            raise RuntimeError("gradients were computed more than backward_passes_per_step times "
                               "before step() or synchronize(); increase backward_passes_per_step "
                               "to accumulate gradients locally")
        self._passes_left[p] -= 1
        if self._passes_left[p] > 0:
            return
        waiting = self._not_ready[unit.name]
        waiting.discard(p)
        if not waiting:
            if self.overlap:
                self._launch(unit)
            else:      # serial baseline: exchanges start in synchronize(); note when it was ready
                self._timer.unit_ready(unit.name, self._timer.now(), 0.0)

    def _launch(self, unit: ExchangeUnit, from_hook: bool = True) -> None:
        """Select this unit's entries, stage its residual and start its exchange (no waiting).

        Sparse unit: ``acc = eps + g`` is written once into the staging buffer, selected,
        its sent entries zeroed there (the next residual), and the unit's range of the
        gradient buffer zeroed for the merge. Dense unit: ``g + eps`` is written into the
        gradient buffer and allreduced in place. No value is read to the host: a NaN or
        Inf reaches the selected values (``selection``) and so every rank's merge, where
        ``synchronize()`` checks all units at once."""
        ready_at = self._timer.now()
        scale = self._loss_scale()
        grads = self._member_grads(unit, scale)
        state = self._lags
        grad = self._unit_grads[unit.name]
        momentum = self.param_groups[unit.group_index]["momentum"] if state.velocities is not None else None
        if state.is_dense(unit):
            if momentum is not None:   # u = m u + g goes out whole and is kept unmasked
                velocity = state.velocities.accumulate(unit.name, grads, grad_scale=1.0 / scale,
                                                       residual_scale=momentum)
                torch.mul(velocity, scale, out=grad)
            else:
                self._copy_into_arena(unit, grads)
            if unit.name in state.residuals:
                state.residuals.drain_into(unit.name, grad, scale)
            self._started(unit, grad, None, self._dense_exchange.start(unit.name, grad))
        else:
            if momentum is not None:   # u = m u + g; acc = eps + u
                velocity = state.velocities.accumulate(unit.name, grads, grad_scale=1.0 / scale,
                                                       residual_scale=momentum)
                acc = state.residuals.accumulate(unit.name, velocity)
            else:
                acc = state.residuals.accumulate(unit.name, grads, grad_scale=1.0 / scale,
                                                 residual_scale=self._residual_rescale(unit))
            if self._monitoring():
                self._monitored[unit.name] = acc * scale
            values, indices = self._select(acc, state.k[unit.name])
            if scale != 1.0:
                values = values * scale
            self._started(unit, values, indices,
                          self._sparse_exchange.start(unit.name, values, indices, unit.numel))
            state.residuals.retain(unit.name, indices)
            if momentum is not None:   # momentum-factor masking: what was sent restarts
                state.velocities.retain(unit.name, indices)
            grad.zero_()               # the merge adds into this range
        if from_hook:
            self._timer.unit_ready(unit.name, ready_at, self._timer.now() - ready_at)

    def _started(self, unit: ExchangeUnit, values, indices, pending: Pending) -> None:
        self._pending[unit.name] = pending
        if self.exchange_observers:
            event = ExchangeStarted(unit.name, unit.numel, values, indices, pending)
            for observe in self.exchange_observers:
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

        Gradients arrive multiplied by S; the residual is kept unscaled
        (``acc = eps + g / S``) and the selected values go out multiplied by S again,
        so the merged gradient is scaled as the GradScaler expects. With the
        GradScaler's power-of-two scales both multiplications are exact.
        """
        scaler = self._options.grad_scaler
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
        for p, name in zip(unit.params, unit.param_names):
            if p.grad is not None and p.grad.is_sparse:
                if not self._sparse_as_dense:
                    if not self._sparse_grads:
                        warnings.warn(f"lags_hvd: parameter {name!r} has a torch.sparse gradient; it is "
                                      f"densified for top-k selection, which costs a dense buffer of "
                                      f"{p.numel()} entries (pass sparse_as_dense=True to silence this)",
                                      stacklevel=4)
                    self._sparse_grads[p] = p.grad.sparse_dim()
                p.grad = p.grad.to_dense()
        if self._options.local_clip is not None:
            clip_norm_([p.grad for p in unit.params if p.grad is not None],
                       self._local_clip_norm[unit.name] * scale)
        weight_decay = (self.param_groups[unit.group_index]["weight_decay"]
                        if self._lags.velocities is not None else 0.0)
        if weight_decay:
            for p in unit.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.add_(p.detach(), alpha=weight_decay * scale)
        return [p.grad for p in unit.params]

    def _residual_rescale(self, unit: ExchangeUnit) -> float:
        """With ``lr_scaled_residual``: eta_{t-1} / eta_t, which keeps eps in the paper's
        lr-scaled space when the lr changes (eta_t is recorded when the step commits)."""
        if not self._options.lr_scaled_residual:
            return 1.0
        lr = self._group_lr.get(unit.group_index)
        if lr is None:   # read once per param group and iteration (a tensor lr: one host read)
            lr = self._group_lr[unit.group_index] = float(self.param_groups[unit.group_index]["lr"])
        if not lr > 0:
            raise ValueError(f"lr_scaled_residual needs a positive learning rate, got {lr} "
                             f"for {unit.name!r}")
        self._staged_lr[unit.name] = lr
        previous = self._lags.exchange_lr.get(unit.name, lr)
        return previous / lr if previous != lr else 1.0

    # ------------------------------------------------------------------ Horovod API
    def _start_token(self, backward: bool) -> None:
        """Start this iteration's step check. ``fresh``: a backward pass ran on this rank, or
        every gradient is None or zero (a rank with an empty batch, as Horovod allows); a
        rank whose gradients are the last step's merged ones (``step()`` called twice) is not."""
        changed = next((i + 1 for i, (_, p, trains) in enumerate(self._watched) if p.requires_grad != trains), 0)
        fresh = backward or all(p.grad is None or not _nonzero(p.grad) for p in self._unit_of)
        self._token.start(self._lags.iteration, fresh, self._lags.k_digest, changed, self._loss_scale())

    def synchronize(self) -> None:
        """Finish every unit's exchange and write the merged gradients into ``p.grad``.

        Units whose hooks did not fire on this rank (parameters unused here) are
        exchanged now with a zero gradient, so every rank takes part in every
        collective and none waits forever. Before any exchanged value is used, the
        step check (``agreement.StepToken``) confirms that every rank is at the same
        iteration with the same plan. On a rank outside the ``process_set`` this does
        nothing: its gradients stay local, as with Horovod.
        """
        if not self._member:
            self._synchronized = True
            return
        self._check_usable()
        try:
            self._synchronize()
        except BaseException as error:
            self._fail(error)
            raise

    def _synchronize(self) -> None:
        if not self._token.started:
            self._start_token(backward=False)
        for unit in self._lags.units:
            if unit.name not in self._pending:
                self._launch(unit, from_hook=False)
        units = {unit.name: unit for unit in self._lags.units}
        self._skip_step = False
        try:
            started = self._timer.now()
            # the step check first: ranks out of step may wait on exchanges of different names
            self._token.check(lambda i: self._watched[i][0])
            arrived = {name: pending.collect() for name, pending in self._pending.items()}
            collected = self._timer.now()
            broken = self._merge(units, arrived)
            merge = self._timer.now() - collected
            wait = collected - started
            if broken:
                self._skip_nonfinite_step(broken)
            else:
                self._lags.commit()
                self._lags.exchange_lr.update(self._staged_lr)
                if self._monitored:
                    self._measure_assumption(units)
            self._bind_grads()
        finally:
            self._pending.clear()
            self._monitored.clear()
            self._lags.discard()   # whatever was not committed
            self._staged_lr.clear()
            self._scale = None
            self._group_lr.clear()
            self._reset_pass_counters()
            self._token.forget()   # after an error before the check: no handle is left behind
        self._timer.end_iteration(wait, merge)
        self._lags.iteration += 1
        if self._auto_buckets is not None:
            buckets = self._auto_buckets.after_synchronize(self._lags.iteration, self._timer, self._lags.units)
            if buckets is not None:
                self._rebucket(buckets)
        k = self._adaptive.after_synchronize(self._lags.iteration, self._timer) if self._adaptive else None
        if k is not None:
            self._lags.set_plan(k)
        else:
            self._lags.apply_schedule()
        self._synchronized = True

    def _merge(self, units: dict[str, ExchangeUnit], arrived: dict) -> list[str]:
        """Write every unit's reduced gradient into the gradient buffer: the sparse units of
        each arena in one ``merge_into``, the dense ones (reduced in place) copied only where
        the wire changed their dtype. Returns the units with a NaN or Inf, found with one
        host read in all (a second only when something is not finite)."""
        parts: dict = {}
        flags, checks = [], []
        for name, result in arrived.items():
            slot = self._layout.unit_slots[name]
            if self._lags.is_dense(units[name]):
                reduced = self._pending[name].finish(result)
                target = self._unit_grads[name]
                if reduced.data_ptr() != target.data_ptr():
                    target.copy_(reduced)
                flags.append(finite_flag(target))
                checks.append(([name], target))
            else:
                values, indices = self._pending[name].finish(result)
                parts.setdefault(slot.key, []).append((slot.start, values, indices, slot.numel, name))
        for key, unit_parts in parts.items():
            merged = self._sparse_exchange.merge_into(self._grads[key], [part[:4] for part in unit_parts])
            flags.append(finite_flag(merged))
            checks.append(([part[4] for part in unit_parts], None))
        if not flags or bool(torch.stack(flags).all()):
            return []
        broken = []   # the rare path: which units, exactly
        for names, tensor in checks:
            for name in names:
                if not all_finite(tensor if tensor is not None else self._unit_grads[name]):
                    broken.append(name)
        return sorted(broken)

    def _bind_grads(self) -> None:
        """Point every ``p.grad`` at its view of the gradient buffer (a ``torch.sparse``
        gradient is handed back sparse)."""
        for p, view in self._grad_views.items():
            if p in self._sparse_grads:   # as it came (nn.Embedding: one sparse dimension)
                p.grad = view.to_sparse(self._sparse_grads[p])
            elif p.grad is not view:
                p.grad = view

    def _skip_nonfinite_step(self, broken: list[str]) -> None:
        """NaN or Inf reached a merged gradient (every rank sees the same ones): this
        iteration is dropped everywhere. The staged residuals are discarded, so every
        residual is exactly what it was before the iteration; ``step()`` skips the
        update; ``p.grad`` keeps the non-finite merged values for inspection (and for
        a GradScaler, which then skips its step and lowers its scale)."""
        self._skip_step = True
        self.skipped_steps += 1
        if self._options.grad_scaler is None:  # with a GradScaler, overflows are routine
            warnings.warn(f"lags_hvd: non-finite gradient in {', '.join(broken)} at iteration "
                          f"{self._lags.iteration}: the step is skipped on every rank and the "
                          "residuals are left as they were", RuntimeWarning, stacklevel=3)

    def _monitoring(self) -> bool:
        every = self._options.monitor_every
        return bool(every) and self._lags.iteration % every == 0

    def _measure_assumption(self, units) -> None:
        """delta per sparse unit: the dense average of acc against what was applied."""
        averages = {name: self._dense_exchange.start(f"monitor.{name}", acc)
                    for name, acc in sorted(self._monitored.items())}
        self.assumption_log.append({"iteration": self._lags.iteration, "delta": {
            name: delta(pending.wait(), self._unit_grads[name], self._lags.k[name],
                        units[name].numel)
            for name, pending in averages.items()}})

    def _reset_pass_counters(self) -> None:
        for p in self._passes_left:
            self._passes_left[p] = self.backward_passes_per_step
        for unit in self._lags.units:
            self._not_ready[unit.name] = set(unit.params)

    def set_backward_passes_per_step(self, passes: int) -> None:
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        self.backward_passes_per_step = passes
        self._reset_pass_counters()

    @contextmanager
    def skip_synchronize(self):
        """Make ``step()`` skip synchronization, after an explicit ``synchronize()``::

            loss.backward()
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if not self._member:
            return super().step(closure)
        self._check_usable()
        if self._should_synchronize and self._options.grad_scaler is not None:
            raise RuntimeError(
                "with grad_scaler, synchronize before the GradScaler reads the gradients:\n"
                "    scaler.scale(loss).backward()\n    optimizer.synchronize()\n"
                "    scaler.unscale_(optimizer)  # optional, e.g. for clipping\n"
                "    with optimizer.skip_synchronize():\n        scaler.step(optimizer)\n"
                "    scaler.update()")
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(f"{HOROVOD_STEP_WARNING} lags_hvd: the gradients were already exchanged by "
                              "synchronize(); this step applies them without exchanging them again.",
                              stacklevel=2)
            elif self._initialises_state():
                return super().step(closure)
            else:
                self.synchronize()
        self._synchronized = False
        if self._skip_step:
            self._skip_step = False
            return None
        if self._lags.velocities is None:
            return super().step(closure)
        # momentum correction: the merged gradient already holds momentum and weight decay
        saved = [(group["momentum"], group["weight_decay"]) for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["momentum"], group["weight_decay"] = 0.0, 0.0
            return super().step(closure)
        finally:
            for group, (momentum, weight_decay) in zip(self.param_groups, saved):
                group["momentum"], group["weight_decay"] = momentum, weight_decay

    def _initialises_state(self) -> bool:
        """Whether this ``step()`` is Horovod's state initialisation, not a training step.

        Horovod's ``broadcast_optimizer_state`` (``lags_hvd``'s calls it) fills an optimizer
        without state by setting every trainable gradient to zero and calling ``step()``,
        on the ranks that have no state only (e.g. all but the one that loaded a
        checkpoint). Exchanging there would hang those ranks. Such a call is recognised by
        its caller, Horovod's function, and runs only the wrapped optimizer's own step:
        residuals, iteration and plan untouched."""
        if self._token.started or self._pending:
            return False
        frame = sys._getframe(1)
        for _ in range(_CALLER_DEPTH):      # step() may be wrapped by torch's optimizer hooks
            if frame is None:
                return False
            if frame.f_code is _HOROVOD_BROADCAST_STATE:
                return True
            frame = frame.f_back
        return False

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._check_usable()
        if self._pending:
            raise RuntimeError("optimizer.zero_grad() was called after loss.backward() but before "
                               "optimizer.step() or optimizer.synchronize(): the exchanges in "
                               "flight would race with it")
        return super().zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group) -> None:
        """Refused after wrapping: the new parameters would have no exchange hooks, and
        their gradients would silently stay local to each rank."""
        if "_lags" in self.__dict__:
            raise RuntimeError("add_param_group() after DistributedOptimizer() wrapped the optimizer: "
                               "add every parameter group to the optimizer before wrapping it")
        return super().add_param_group(param_group)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self):
        """The wrapped optimizer's state plus this rank's LAGS state under ``'lags'``
        (residuals, k, iteration, and the worker count and rank they belong to)."""
        state = super().state_dict()
        state[_STATE_KEY] = self._lags.state_dict()
        state[_STATE_KEY]["world_size"] = self._config.world
        state[_STATE_KEY]["rank"] = hvd.rank()
        return state

    def load_state_dict(self, state_dict) -> None:
        """Restore the wrapped optimizer's state and this rank's LAGS state, all or nothing.

        A state without ``'lags'`` (e.g. from a plain optimizer) leaves the LAGS state as
        it is. Residuals are one worker's unsent gradient: a state saved by another rank
        or with a different number of workers keeps its k and iteration but resets the
        residuals to zero, with a warning, so no gradient is sent twice or lost silently.
        Everything is checked before anything changes: a state that does not fit raises
        ``ValueError`` and leaves the optimizer exactly as it was.
        """
        if self._pending:
            raise RuntimeError("load_state_dict() while exchanges are in flight; call it before "
                               "backward or after step()")
        state_dict = dict(state_dict)
        saved = state_dict.pop(_STATE_KEY, None)
        load_lags, reason = None, None
        if saved is not None:
            if not isinstance(saved, dict):
                raise ValueError("the optimizer state's 'lags' entry is not a dict")
            world, rank = self._config.world, hvd.rank()
            if saved.get("world_size", world) != world:
                reason = f"was saved with {saved['world_size']} workers, this run has {world}"
            elif "rank" not in saved:
                reason = "does not say which rank's residuals it holds (saved by an older lags_hvd)"
            elif saved["rank"] != rank:
                reason = f"holds rank {saved['rank']}'s residuals, this is rank {rank}"
        engine, was_planned = self._engine_parts(), getattr(self._auto_buckets, "planned", None)
        adopted = self._adopt_buckets(saved) if saved is not None else False
        try:
            if saved is not None:
                load_lags = self._lags.prepare_load(saved, adopt_k=self._options.adaptive,
                                                    reset_residuals=reason is not None)
            super().load_state_dict(state_dict)   # torch checks the groups before it changes anything
        except BaseException:
            if adopted:
                vars(self).update(engine)         # the optimizer exactly as it was
            if self._auto_buckets is not None:
                self._auto_buckets.planned = was_planned
            raise
        if load_lags is not None:
            load_lags()
            if reason:
                warnings.warn(f"lags_hvd: the checkpoint {reason}: LAGS residuals start from zero "
                              "(a residual is one worker's unsent gradient)", stacklevel=2)
            if self._adaptive:
                self._adaptive.resume(self._lags.iteration)
        self._synchronized = False
        self._should_synchronize = True
        self._reset_pass_counters()

    def _adopt_buckets(self, saved: dict) -> bool:
        """With ``buckets="auto"``: take the buckets of a state saved after its plan (so a
        resumed run exchanges exactly as before) and plan no more. Returns whether the
        buckets changed. Raises ValueError (changing nothing) for buckets that do not
        partition this optimizer's parameters."""
        if self._auto_buckets is None or not isinstance(saved.get("iteration"), int) \
                or saved["iteration"] < self._options.bucket_warmup or "buckets" not in saved:
            return False
        buckets = saved["buckets"]
        trainable = sorted(n for unit in self._lags.units for n in unit.param_names)
        if not isinstance(buckets, list) or not all(isinstance(b, list) and b and all(isinstance(n, str) for n in b)
                                                    for b in buckets) \
                or sorted(n for b in buckets for n in b) != trainable:
            raise ValueError("the saved 'buckets' do not partition this optimizer's trainable parameters: "
                             "the checkpoint is from another model")
        self._auto_buckets.planned = True
        if buckets == self._lags.buckets():
            return False
        self._rebucket(buckets)
        return True

    def adopt_shared_state(self, root_rank: int) -> None:
        """Collective over every rank: take ``root_rank``'s k, iteration and learning-rate
        record (what all ranks must hold alike); residuals stay each rank's own. Called by
        ``lags_hvd.broadcast_optimizer_state`` after Horovod's broadcast."""
        shared = broadcast_object(self._lags.shared_state(), root_rank, "lags.shared_state",
                                  timeout=self._options.exchange_timeout)
        self._adopt_buckets(shared)
        self._lags.adopt(shared)
        if self._adaptive and self._lags.iteration:
            self._adaptive.resume(self._lags.iteration)


def broadcast_optimizer_state(optimizer, root_rank: int, model=None) -> None:
    """Horovod's ``broadcast_optimizer_state``, which also works on a ``DistributedOptimizer``:
    the wrapped optimizer's state comes from ``root_rank`` (ranks without state initialise it
    without exchanging), and so do the LAGS k, iteration and lr record; each rank keeps its
    own residuals. Collective over every rank. Horovod's resume pattern::

        if hvd.rank() == 0:
            model.load_state_dict(ckpt["model"]); optimizer.load_state_dict(ckpt["optimizer"])
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    """
    hvd.broadcast_optimizer_state(optimizer, root_rank, model=model)
    if isinstance(optimizer, _LAGSOptimizer):
        optimizer.adopt_shared_state(root_rank)


_HOROVOD_BROADCAST_STATE = hvd.broadcast_optimizer_state.__code__
_CALLER_DEPTH = 4


def _plain(value):
    """A hyper-parameter as a comparable value: a tensor (a capturable lr) by its values, not
    its device, which differs between ranks on one machine."""
    return value.tolist() if isinstance(value, torch.Tensor) else repr(value)


def _nonzero(grad: torch.Tensor) -> bool:
    return bool((grad._values() if grad.is_sparse else grad).any())


def _k_for(densities: dict[str, float], units) -> dict[str, int]:
    return {u.name: k_for_density(densities[u.name], u.numel) for u in units}


@functools.cache
def _distributed_class(base: type) -> type:
    return type(base.__name__, (_LAGSOptimizer, base), {"__module__": __name__})


def DistributedOptimizer(optimizer, named_parameters=None, compression=hvd.Compression.none,
                         backward_passes_per_step=1, op=hvd.Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=hvd.global_process_set, **lags_options):
    """Wrap ``optimizer`` so that gradients are exchanged with LAGS-SGD.

    The positional arguments are ``hvd.DistributedOptimizer``'s, in its order:

    Args:
        optimizer: the ``torch.optim.Optimizer`` to wrap; it is re-classed in place
            and returned, its state kept.
        named_parameters: ``model.named_parameters()``; names the exchanges and keys
            the residuals in checkpoints. Without it, names are positional.
        compression: Horovod compression of the values on the wire (``Compression.fp16``).
        backward_passes_per_step: backward passes accumulated locally before one exchange.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        gradient_predivide_factor: with Average, scale by 1/f before the sum and f/P after.
        num_groups: split the parameters (in name order) into this many exchange units.
        groups: explicit exchange units, a list of lists of parameters; each list is
            sparsified as one vector. One list of all parameters gives TopK-SGD.
        sparse_as_dense: densify ``torch.sparse`` gradients instead of refusing them.
        process_set: the Horovod process set whose ranks exchange; on a rank outside it the
            optimizer steps on local gradients, as Horovod's does.

    Keyword-only LAGS options (``lags_hvd.options.LAGSOptions`` explains each):
        density (0.001, a number in (0, 1] or ``"adaptive"``), layer_densities,
        selector, trust_selector, lr_scaled_residual, grad_scaler, exchange_timeout,
        buckets, bucket_warmup, monitor_every, density_warmup, density_warmup_start,
        momentum_correction, dense_params, local_clip, and for the adaptive mode
        min_density, max_density, warmup_iterations, replan_every, network_profile,
        plan_slack, plan_report_dir, verbose.

    Collective over the process set: every rank compares its settings with the others'
    before any exchange and raises ``RanksDisagreeError`` where they differ.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _LAGSOptimizer):
        raise TypeError("this optimizer is already a lags_hvd.DistributedOptimizer")
    original_class, original_attributes = type(optimizer), set(vars(optimizer))
    optimizer.__class__ = _distributed_class(original_class)   # the same object, re-classed
    try:
        optimizer._lags_init(named_parameters, compression, backward_passes_per_step, op,
                             gradient_predivide_factor, num_groups, groups, sparse_as_dense,
                             process_set, lags_options)
    except BaseException:   # leave the user's optimizer exactly as it was
        for added in set(vars(optimizer)) - original_attributes:
            delattr(optimizer, added)
        optimizer.__class__ = original_class
        raise
    return optimizer


def TopKDistributedOptimizer(optimizer, named_parameters=None, compression=hvd.Compression.none,
                             backward_passes_per_step=1, op=hvd.Average, gradient_predivide_factor=1.0,
                             sparse_as_dense=False, process_set=hvd.global_process_set, *,
                             density=0.001, **lags_options):
    """TopK-SGD ("SLGS", global sparsification): the baseline LAGS-SGD improves on.

    One exchange unit holds every trainable parameter, so a single top-k runs over
    the whole model's concatenated gradient, with the same residual scheme, once
    the last gradient of backprop is ready: no overlap with computation. Arguments
    as ``DistributedOptimizer``; ``density`` must be a number.
    """
    if density == ADAPTIVE or lags_options.get("buckets", "layer") != "layer":
        raise ValueError("TopKDistributedOptimizer takes a fixed density and one global unit")
    everything = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    return DistributedOptimizer(optimizer, named_parameters, compression, backward_passes_per_step, op,
                                gradient_predivide_factor, 0, [everything], sparse_as_dense, process_set,
                                density=density, **lags_options)
