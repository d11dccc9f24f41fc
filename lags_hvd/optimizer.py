"""The LAGS ``DistributedOptimizer`` over any backend's collectives (front-ends: ``horovod_api``).

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

A unit of density 1 skips selection and uses the dense allreduce, so the whole
optimizer at density 1 computes exactly what ``hvd.DistributedOptimizer`` computes.

The wrapper re-classes the user's optimizer instance (its parameters, groups,
hyper-parameters and state are kept, not copied), so learning-rate schedulers,
``GradScaler`` and ``isinstance`` checks keep working.

Ranks agree or fail loudly (``agreement``): the settings are compared on every
rank before any exchange, and every iteration carries a small step check, so a
rank out of step raises ``OutOfStepError`` everywhere instead of being summed
with the others. Every wait is bounded (``exchange_timeout``). Ranks outside the
group that exchanges (a Horovod ``process_set``) step on their local gradients, as with Horovod.
"""
from __future__ import annotations

import functools
import gc
import math
import time
import warnings
import weakref
from contextlib import contextmanager
from typing import Callable

import torch

from . import selection
from .adaptive import AdaptiveDensity, AutoBuckets
from .agreement import agree_on_settings, wire_namespace
from .checks import check_count
from .collectives import DEFAULT_TIMEOUT, Collectives, broadcast_object
from .density import dense_policy_units, param_density, sent_dense, unit_k
from .engine import Engine, EngineContext, Outcome
from .errors import ExchangeTimeoutError
from .exchange import ExchangeConfig, ExchangeStarted
from .layout import build_units, name_parameters, small_tensor_groups
from .options import LAGSOptions
from .profiling import BackwardTimer
from .report import PlanReporter
from .state import LAGSState

__all__ = ["wrap", "join_all"]

_STATE_KEY = "lags"

HOROVOD_STEP_WARNING = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                        "optimizer.synchronize().")
"""Horovod's own warning sentence, kept verbatim as the start of ours (scripts match it)."""


class _LAGSOptimizer:
    """Mixin placed in front of the wrapped optimizer's class; see ``DistributedOptimizer``."""

    # ------------------------------------------------------------------ set-up
    def _lags_init(self, collectives: Collectives, member: bool, named_parameters, compression,
                   backward_passes_per_step, op: str, gradient_predivide_factor, num_groups, groups,
                   sparse_as_dense, lags_options: dict):
        """Validate locally, agree with every rank (one collective), then wire the hooks.

        ``collectives``: the group that exchanges; ``member``: whether this rank is in it;
        ``op``: "average", "sum", or the name of an op lags_hvd does not support. A rank
        whose own validation fails still takes part in the agreement, so the others raise a
        clear error instead of waiting for it."""
        self._member = included = member
        options, settings, error = None, None, None
        if lags_options.get("buckets") is None and (num_groups or groups is not None):
            lags_options = {**lags_options, "buckets": "layer"}   # the user's groups are the buckets
        try:
            options = LAGSOptions(**lags_options)
            self._configure(options, collectives, named_parameters, compression, backward_passes_per_step, op,
                            gradient_predivide_factor, num_groups, groups, sparse_as_dense)
            settings = self._settings(backward_passes_per_step, sparse_as_dense)
        except (ValueError, TypeError) as refused:
            error = refused
        if included:   # non-members exchange nothing, as with Horovod: they step locally
            agree_on_settings(settings, error, collectives, options.exchange_timeout if options else DEFAULT_TIMEOUT)
        elif error is not None:
            raise error
        hook = _weak_hook(weakref.ref(self))
        self._hook_handles = [p.register_post_accumulate_grad_hook(hook) for p in self._engine.params] \
            if included else []
        weakref.finalize(self, _remove_hooks, self._hook_handles)
        _LIVE[:] = [ref for ref in _LIVE if ref() is not None] + [weakref.ref(self)]

    def _configure(self, options: LAGSOptions, collectives: Collectives, named_parameters, compression,
                   backward_passes_per_step, op: str, gradient_predivide_factor, num_groups, groups,
                   sparse_as_dense) -> None:
        """Everything that needs no communication: units, k, exchanges; raises on bad input."""
        if isinstance(self, torch.optim.LBFGS):
            raise TypeError("LBFGS evaluates its closure several times per step, and every evaluation's "
                            "gradients would need an exchange of their own: it cannot be wrapped")
        self._names = names = name_parameters(self.param_groups, named_parameters)
        if sum(map(bool, (num_groups, groups is not None, options.buckets != "layer"))) > 1:
            raise ValueError("pass only one of num_groups, groups and buckets")
        check_count(backward_passes_per_step, "backward_passes_per_step", 1)
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
        if op not in ("average", "sum"):
            raise ValueError("lags_hvd supports op=hvd.Average and op=hvd.Sum; Adasum, Min, Max and "
                             f"Product have no meaning for a sparse sum (got {op})")
        config = ExchangeConfig(collectives, average=op == "average",
                                gradient_predivide_factor=gradient_predivide_factor, compression=compression,
                                timeout=options.exchange_timeout,
                                namespace=wire_namespace([names[p] for p in trainable]))
        refused = self._momentum_correction_refused(units)
        momentum_correction = options.momentum_correction
        if momentum_correction is None:   # the recipe's: wherever it applies to a sparse unit
            k, dense = unit_k(options, units), set(dense_policy_units(units, options))
            sparse = options.adaptive or any(k[u.name] < u.numel and u.name not in dense for u in units)
            momentum_correction = sparse and refused is None
        if momentum_correction and refused:
            raise ValueError(refused)
        self._context = EngineContext(
            options, config, self.param_groups,
            # backprop usually produces gradients in reverse registration order
            param_order=[p for g in reversed(self.param_groups) for p in reversed(g["params"])],
            select=selection.get_selector(options.selector, checked=not options.trust_selector),
            watched=[(names[p], p, p.requires_grad) for g in self.param_groups for p in g["params"]],
            backward_passes_per_step=backward_passes_per_step, sparse_as_dense=sparse_as_dense,
            momentum_correction=momentum_correction)
        self._engine = Engine(units, self._context)
        self._adaptive = None
        if options.adaptive and options.buckets != "auto":
            self._start_adaptive()
        self._auto_buckets = AutoBuckets(options, collectives, *self._bucket_kinds()) \
            if options.buckets == "auto" else None
        self._skip_step = False
        self._failed: str | None = None       # set by an error in a hook or synchronize()
        self.skipped_steps = 0
        self.assumption_log: list[dict] = []
        self.grad_norm: torch.Tensor | None = None   # max_grad_norm: the last merged norm, unclipped
        self._synchronized = False
        self._should_synchronize = True
        self.overlap = True

    @property
    def exchange_observers(self) -> list[Callable[[ExchangeStarted], None]]:
        """Callables told of every exchange as it starts (``exchange.ExchangeStarted``: the
        unit, this rank's values and indices, the pending handle), in the thread that starts
        it: instrumentation for tests and profilers. Empty by default (nothing is called)."""
        return self._context.observers

    def _start_adaptive(self) -> None:
        self._adaptive = AdaptiveDensity(self._options, self._context.config.collectives, self._engine.units,
                                         start=max(self.lags_state.iteration, self._options.density_warmup))   # at k
        self._adaptive.set_floor(self.lags_state.planned_k)
        if self._options.verbose or self._options.plan_report_dir:
            self._adaptive.observers.append(PlanReporter(self._options.verbose, self._options.plan_report_dir))

    def _param_kinds(self) -> dict[torch.Tensor, tuple]:
        """Per trainable parameter, what must agree for parameters to share a bucket: param
        group, dtype, device, density and whether the ``dense_params`` policy sends it whole."""
        kinds = {}
        for index, group in enumerate(self.param_groups):
            for p in group["params"]:
                name = self._names[p]
                dense = sent_dense(self._options, name, p)
                kinds[p] = (index, p.dtype, p.device, 1.0 if dense else param_density(self._options, name), dense)
        return kinds

    def _bucket_kinds(self) -> tuple[dict[str, tuple], dict[str, float]]:
        """``_param_kinds`` and each parameter's density, by name, for ``AutoBuckets``."""
        kinds = {self._names[p]: kind for p, kind in self._param_kinds().items()}
        return kinds, {name: kind[3] for name, kind in kinds.items()}

    def _rebucket(self, buckets: list[list[str]]) -> None:
        """Apply a bucket plan (lists of parameter names) on this rank."""
        by_name = {name: p for p, name in self._names.items()}
        units = build_units(self.param_groups, self._names, [[by_name[n] for n in bucket] for bucket in buckets])
        self._engine = Engine(units, self._context, previous=self._engine)
        if self._options.adaptive:
            self._start_adaptive()

    def _settings(self, backward_passes_per_step, sparse_as_dense) -> dict:
        """What every rank must set alike, for ``agreement.agree_on_settings``."""
        config = self._context.config
        units = self._engine.units
        return {"model": [(name, tuple(p.shape), str(p.dtype)) for unit in units
                          for name, p in zip(unit.param_names, unit.params)],
                "exchange units": [unit.name for unit in units],
                "collective names": config.namespace,
                "k": dict(self.lags_state.k),
                "options": self._options.shared_settings(),
                "momentum correction in force": self._context.momentum_correction,
                # the hyper-parameters' values are compared at every step (the step check), so
                # that Horovod's pattern of aligning them with broadcast_optimizer_state works
                "wrapped optimizer": {"class": self._wrapped_class.__qualname__, "param groups": [
                    sorted(key for key in group if key != "params") for group in self.param_groups]},
                "exchange": {"op": "average" if config.average else "sum",
                             "gradient_predivide_factor": config.gradient_predivide_factor,
                             "compression": getattr(config.compression, "__name__", type(config.compression).__name__),
                             "backward_passes_per_step": backward_passes_per_step,
                             "sparse_as_dense": bool(sparse_as_dense)}}

    def _momentum_correction_refused(self, units) -> str | None:
        """Why ``momentum_correction`` cannot apply to the wrapped optimizer, or None."""
        if self._wrapped_class is not torch.optim.SGD:   # its step is replaced by x -= lr * update
            return ("momentum_correction applies to torch.optim.SGD itself with momentum (it replaces its "
                    f"step); the wrapped optimizer is {self._wrapped_class.__qualname__}")
        for unit in units:
            group = self.param_groups[unit.group_index]
            if not group["momentum"] > 0 or group["dampening"] != 0 or group["nesterov"] \
                    or group.get("maximize", False):
                return ("momentum_correction needs SGD with momentum > 0, dampening 0, "
                        f"nesterov=False and maximize=False; param group {unit.group_index} has momentum "
                        f"{group['momentum']}, dampening {group['dampening']}, nesterov "
                        f"{group['nesterov']}, maximize {group.get('maximize', False)}")
        return None

    @property
    def options(self) -> LAGSOptions:
        """The LAGS options as validated, the recipe's defaults resolved (frozen)."""
        return self._options

    @property
    def _parameter_names(self) -> dict:
        """``{parameter: name}``, under the name Horovod's optimizer keeps it (its tests read it)."""
        return self._names

    @property
    def lags_state(self) -> LAGSState:
        """The LAGS-SGD state object (units, k per unit, residuals)."""
        return self._engine.state

    @property
    def backward_passes_per_step(self) -> int:
        """Backward passes accumulated locally before one exchange (``set_backward_passes_per_step``)."""
        return self._context.backward_passes_per_step

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
        return self._engine.in_flight

    @property
    def traffic(self) -> dict[str, dict[str, int]]:
        """Per sparse unit, the bytes this worker sent to and received from the other ranks
        in its last exchange (what the aggregation moves, by its algorithm: an allgather
        sends and receives its message P-1 times; ``regions.traffic`` for reduce_scatter)."""
        return {name: {"sent": sent, "received": received}
                for name, (sent, received) in self._engine.traffic.items()}

    @property
    def backward_timer(self) -> BackwardTimer:
        """Hook timestamps and selection times of recent iterations."""
        return self._engine.timer

    # ------------------------------------------------------------------ backward hooks
    def _on_grad_ready(self, p) -> None:
        self._check_usable()
        try:
            self._engine.gradient_ready(p, self.overlap)
        except BaseException as error:
            self._fail(error)
            raise

    def _check_usable(self) -> None:
        if self._failed:
            raise RuntimeError(
                f"lags_hvd: this optimizer failed at iteration {self.lags_state.iteration} ({self._failed}). That "
                "iteration's gradients already hold residuals and its exchanges cannot be completed, so it "
                "cannot go on: stop this process and restart from the last checkpoint (the residuals in "
                "state_dict() are still those of the last completed step)")

    def _fail(self, error: BaseException) -> None:
        """Mark the optimizer unusable after an error in a hook or in synchronize(): going on
        would add the residuals to gradients that already hold them."""
        self._failed = f"{type(error).__name__}: {str(error)[:200]}"

    # ------------------------------------------------------------------ Horovod API
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
        self._skip_step = False
        outcome = self._engine.finish()
        self.grad_norm = outcome.grad_norm
        if outcome.nonfinite:
            self._skip_nonfinite_step(outcome)
        elif outcome.delta is not None:
            self.assumption_log.append({"iteration": outcome.iteration, "delta": outcome.delta})
        state = self._engine.state
        if outcome.joined:   # the planners broadcast, which Horovod refuses while ranks sit in hvd.join()
            state.apply_schedule()
            self._synchronized = True
            return
        if self._auto_buckets is not None:
            buckets = self._auto_buckets.after_synchronize(state.iteration, self._engine.timer, self._engine.units)
            if buckets is not None:
                self._rebucket(buckets)
                state = self._engine.state
        k = self._adaptive.after_synchronize(state.iteration, self._engine.timer) if self._adaptive else None
        if k is not None:
            state.set_plan(k)
        else:
            state.apply_schedule()
        self._synchronized = True

    def _skip_nonfinite_step(self, outcome: Outcome) -> None:
        """NaN or Inf reached a merged gradient (every rank sees the same ones): this
        iteration is dropped everywhere. The staged residuals are discarded, so every
        residual is exactly what it was before the iteration; ``step()`` skips the
        update; ``p.grad`` keeps the non-finite merged values for inspection (and for
        a GradScaler, which then skips its step and lowers its scale)."""
        self._skip_step = True
        self.skipped_steps += 1
        if self._options.grad_scaler is None:  # with a GradScaler, overflows are routine
            warnings.warn(f"lags_hvd: non-finite gradient in {', '.join(outcome.nonfinite)} at iteration "
                          f"{outcome.iteration}: the step is skipped on every rank and the "
                          "residuals are left as they were", RuntimeWarning, stacklevel=3)

    def set_backward_passes_per_step(self, passes: int) -> None:
        check_count(passes, "backward_passes_per_step", 1)
        self._context.backward_passes_per_step = passes
        self._engine.reset_pass_counters()

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
        """Exchange (unless inside ``skip_synchronize()``), then the wrapped optimizer's update.

        ``closure`` (torch's API: it zeroes the gradients, computes the loss and calls
        ``backward()``) runs first, so the gradients of its backward pass are the ones
        exchanged; the wrapped optimizer then steps without it, and the closure's loss is
        returned. (Horovod's optimizer hands the closure to the wrapped step after the
        exchange, so the update uses the closure's local, unexchanged gradients.)"""
        if not self._member:
            return super().step(closure)
        self._check_usable()
        loss = self._run_closure(closure) if closure is not None else None
        if self._should_synchronize and self._options.grad_scaler is not None:
            raise RuntimeError(
                "with grad_scaler, synchronize before the GradScaler reads the gradients:\n"
                "    scaler.scale(loss).backward()\n    optimizer.synchronize()\n"
                "    scaler.unscale_(optimizer)  # optional, e.g. for clipping\n"
                "    with optimizer.skip_synchronize():\n        scaler.step(optimizer)\n"
                "    scaler.update()")
        if not self._should_synchronize and not self._synchronized:
            raise RuntimeError(
                "optimizer.step() inside optimizer.skip_synchronize() without optimizer.synchronize() "
                "first: the gradients have not been exchanged, and this rank would step on its own. "
                "Call optimizer.synchronize() after backward and before skip_synchronize()")
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(f"{HOROVOD_STEP_WARNING} lags_hvd: the gradients were already exchanged by "
                              "synchronize(); this step applies them without exchanging them again.",
                              stacklevel=2)
            elif self._initialises_state():   # under momentum correction the wrapped SGD keeps no state
                return None if self.lags_state.velocities is not None else super().step()
            else:
                self.synchronize()
        self._synchronized = False
        if self._skip_step:
            self._skip_step = False
            return loss
        if self.lags_state.velocities is None:
            super().step()
        else:
            self._step_on_the_update()
        return loss

    @torch.no_grad()
    def _step_on_the_update(self) -> None:
        """Momentum correction: the merged gradient already is the update (momentum and weight
        decay are in it), so ``x -= lr * grad``: the wrapped SGD's step with momentum 0 and no
        weight decay, its ``param_groups`` read, never changed (a scheduler or logger reading
        them mid-step sees the user's values)."""
        for group in self.param_groups:
            lr = group["lr"]
            for p in group["params"]:
                if p.grad is not None:
                    if isinstance(lr, torch.Tensor):
                        p.sub_(p.grad * lr)
                    else:
                        p.add_(p.grad, alpha=-lr)

    def _run_closure(self, closure):
        """``step(closure)``: the closure's loss, its backward pass exchanging as any other."""
        if not self._should_synchronize or self._synchronized:
            raise RuntimeError("step(closure) after synchronize() or inside skip_synchronize(): the "
                               "closure's backward pass would start exchanges this step does not wait "
                               "for. Call step(closure) alone, or backward, synchronize() and step()")
        with torch.enable_grad():
            return closure()

    def _initialises_state(self) -> bool:
        """Whether this ``step()`` is Horovod's ``broadcast_optimizer_state`` initialising a
        fresh optimizer, not a training step, recognised by what that function does: on an
        optimizer without state, it replaces every trainable gradient by a new tensor of
        zeros and calls ``step()``, with no backward pass since the last step. (A rank with
        an empty batch zeroes the gradients it holds, views of the merged buffer, or leaves
        them None: that step exchanges.) Exchanging here would hang the ranks it runs on,
        those without state, so it steps locally: residuals, iteration and plan untouched."""
        if not self._engine.idle or self.state:
            return False
        grads = [(p, p.grad) for group in self.param_groups for p in group["params"] if p.requires_grad]
        return all(grad is not None and not self._engine.holds(p, grad) and not grad.any() for p, grad in grads)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._check_usable()
        if self._engine.in_flight:
            shown = ", ".join(self._engine.in_flight_units[:5])
            raise RuntimeError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                f"optimizer.synchronize(): the exchanges in flight ({self._engine.in_flight}: {shown}...) "
                "would race with it. If that backward pass was meant for another optimizer "
                "(a GAN's generator loss backpropagated through an "
                "unfrozen discriminator), freeze these parameters for it (requires_grad_(False)) or "
                "detach their output; otherwise call step() before zero_grad()")
        return super().zero_grad(set_to_none=set_to_none)

    def __getstate__(self):
        """Refused: a copy would share this optimizer's hooks (on the model's parameters) and
        collective names, and pickling could not rebuild either."""
        raise TypeError("a lags_hvd DistributedOptimizer cannot be copied or pickled (its hooks belong to "
                        "the model's parameters, its exchanges to this object): save state_dict(), and "
                        "wrap a new optimizer for the copy of the model with DistributedOptimizer()")

    def add_param_group(self, param_group) -> None:
        """Refused after wrapping: the new parameters would have no exchange hooks, and
        their gradients would silently stay local to each rank."""
        if "_engine" in self.__dict__:
            raise RuntimeError("add_param_group() after DistributedOptimizer() wrapped the optimizer: "
                               "add every parameter group to the optimizer before wrapping it")
        return super().add_param_group(param_group)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self):
        """The wrapped optimizer's state plus this rank's LAGS state under ``'lags'``
        (residuals, k, iteration, and the worker count and rank they belong to)."""
        state = super().state_dict()
        state[_STATE_KEY] = {**self.lags_state.state_dict(), **self._plan_state()}
        state[_STATE_KEY]["world_size"] = self._context.config.world
        state[_STATE_KEY]["rank"] = self._context.config.collectives.global_rank()
        state[_STATE_KEY]["update"] = self.update_rule
        return state

    def _plan_state(self) -> dict:
        """With ``buckets="auto"``: whether the buckets were planned (the checkpoint's
        buckets are then the plan, else the per-layer ones the plan has yet to replace)."""
        return {"buckets_planned": self._auto_buckets.planned} if self._auto_buckets is not None else {}

    @property
    def update_rule(self) -> dict:
        """The options that shape the update and the saved state (velocities; which units keep
        residuals), as resolved for this optimizer: recipe, momentum_correction, dense_params."""
        return {"recipe": self._options.recipe, "momentum_correction": self._context.momentum_correction,
                "dense_params": self._options.dense_params}

    def load_state_dict(self, state_dict) -> None:
        """Restore the wrapped optimizer's state and this rank's LAGS state, all or nothing.

        A state without ``'lags'`` (e.g. from a plain optimizer) leaves the LAGS state as
        it is. Residuals are one worker's unsent gradient: a state saved by another rank
        or with a different number of workers keeps its k and iteration but resets the
        residuals to zero, with a warning, so no gradient is sent twice or lost silently.
        Everything is checked before anything changes: a state that does not fit raises
        ``ValueError`` and leaves the optimizer exactly as it was.
        """
        if self._engine.in_flight:
            raise RuntimeError("load_state_dict() while exchanges are in flight; call it before "
                               "backward or after step()")
        state_dict = dict(state_dict)
        saved = state_dict.pop(_STATE_KEY, None)
        load_lags, reason = None, None
        if saved is not None:
            if not isinstance(saved, dict):
                raise ValueError("the optimizer state's 'lags' entry is not a dict")
            world, rank = self._context.config.world, self._context.config.collectives.global_rank()
            if saved.get("world_size", world) != world:
                reason = f"was saved with {saved['world_size']} workers, this run has {world}"
            elif "rank" not in saved:
                reason = "does not say which rank's residuals it holds (saved by an older lags_hvd)"
            elif saved["rank"] != rank:
                reason = f"holds rank {saved['rank']}'s residuals, this is rank {rank}"
            _check_update_rule(saved.get("update"), self.update_rule)
        engine, adaptive = self._engine, self._adaptive
        was_planned = getattr(self._auto_buckets, "planned", None)
        adopted = self._adopt_buckets(saved) if saved is not None else False
        try:
            if saved is not None:
                load_lags = self.lags_state.prepare_load(saved, adopt_k=self._options.adaptive,
                                                    reset_residuals=reason is not None,
                                                    world=self._context.config.world)
            super().load_state_dict(state_dict)   # torch checks the groups before it changes anything
        except BaseException as error:
            if isinstance(error, ValueError) and saved is not None and "update" not in saved:
                error.add_note("lags_hvd: this checkpoint predates the recipe option, whose default "
                               "('dgc') turns on momentum correction and sends 1-D parameters dense; a "
                               "checkpoint saved with the defaults of then resumes with recipe='paper' "
                               "(and buckets='auto' if it was planned)")
            if adopted:
                self._engine, self._adaptive = engine, adaptive   # the optimizer exactly as it was
            if self._auto_buckets is not None:
                self._auto_buckets.planned = was_planned
            raise
        if load_lags is not None:
            load_lags()
            if reason:
                warnings.warn(f"lags_hvd: the checkpoint {reason}: LAGS residuals start from zero "
                              "(a residual is one worker's unsent gradient)", stacklevel=2)
            if self._adaptive:
                self._adaptive.resume(self.lags_state.iteration)
        self._synchronized = False
        self._should_synchronize = True
        self._engine.reset_pass_counters()

    def _adopt_buckets(self, saved: dict) -> bool:
        """With ``buckets="auto"``: take the buckets of the saved state and whether they were
        planned, so a resumed run exchanges exactly as the saved one would have: with its
        plan, or per layer until the plan is made at the same iteration. Returns whether the
        buckets changed. Raises ValueError (changing nothing) for buckets that do not
        partition this optimizer's parameters."""
        if self._auto_buckets is None or not isinstance(saved.get("iteration"), int) or "buckets" not in saved:
            return False
        planned = saved.get("buckets_planned")
        if not isinstance(planned, bool):   # saved before the flag: the plan's iteration tells
            planned = saved["iteration"] >= self._options.density_warmup + self._options.bucket_warmup
        buckets = saved["buckets"]
        trainable = sorted(n for unit in self.lags_state.units for n in unit.param_names)
        if not isinstance(buckets, list) or not all(isinstance(b, list) and b and all(isinstance(n, str) for n in b)
                                                    for b in buckets) \
                or sorted(n for b in buckets for n in b) != trainable:
            raise ValueError("the saved 'buckets' do not partition this optimizer's trainable parameters: "
                             "the checkpoint is from another model")
        self._auto_buckets.planned = planned
        if buckets == self.lags_state.buckets():
            return False
        self._rebucket(buckets)
        return True

    def adopt_shared_state(self, root_rank: int) -> None:
        """Collective over every rank: take ``root_rank``'s k, iteration and learning-rate
        record (what all ranks must hold alike); residuals stay each rank's own. Called by
        ``lags_hvd.broadcast_optimizer_state`` after Horovod's broadcast."""
        shared = broadcast_object(self._context.config.collectives,
                                  {**self.lags_state.shared_state(), **self._plan_state()}, root_rank,
                                  "lags.shared_state",
                                  timeout=self._options.exchange_timeout)
        self._adopt_buckets(shared)
        self.lags_state.adopt(shared, self._context.config.world)
        if self._adaptive and self.lags_state.iteration:
            self._adaptive.resume(self.lags_state.iteration)


_LIVE: list[weakref.ref] = []
"""Every DistributedOptimizer of this process, in the order they were built (``join``)."""


def join_all(device: int, fallback: Callable[[int], int]) -> int:
    """``join()`` of a front-end (see ``horovod_api.join``): until every rank has joined,
    take part in the others' iterations with zero gradients (``Engine.shadow``) in every
    live ``DistributedOptimizer`` of this process, so their exchanges complete; its
    parameters, residuals and iteration stay as they are. Returns the rank that joined
    last (the most iterations). Without an optimizer: ``fallback(device)``, the
    front-end's own join. Waits are bounded by the optimizers' ``exchange_timeout``; an
    optimizer that failed takes no part."""
    gc.collect()   # an optimizer the program dropped is collected with its hooks (``_weak_hook``)
    optimizers = [o for o in (ref() for ref in _LIVE) if o is not None and o._member and not o._failed]
    if not optimizers:
        return fallback(device)
    for optimizer in optimizers:
        if not optimizer._engine.idle:
            raise RuntimeError("lags_hvd.join() after a backward pass that no step() followed: "
                               "step (or zero_grad() before backward) first, then join")
    timeouts = [o._options.exchange_timeout for o in optimizers if o._options.exchange_timeout is not None]
    waiting, last = list(optimizers), None
    for optimizer in waiting:
        optimizer._engine.start_shadow()
    progress = time.monotonic()
    while waiting:
        ready = [o for o in waiting if o._engine.shadow_ready]
        for optimizer in ready:
            try:
                check = optimizer._engine.shadow()
            except BaseException as error:
                optimizer._fail(error)
                raise
            if check.iteration is None:   # every rank has joined
                waiting.remove(optimizer)
                last = check.last if last is None else last
            else:
                optimizer._engine.start_shadow()
        if ready:
            progress = time.monotonic()
        elif timeouts and time.monotonic() - progress > min(timeouts):
            raise ExchangeTimeoutError(
                f"lags_hvd.join() on rank {optimizers[0]._context.config.collectives.global_rank()} waited "
                f"{min(timeouts):g} s for an iteration of the ranks still training: one stalled, or "
                "stopped without calling lags_hvd.join()")
        else:
            time.sleep(5e-4)
    return last


def _weak_hook(optimizer_ref: weakref.ref):
    """The backward hook of every parameter: it holds the optimizer weakly (a hook lives as
    long as its parameter, and torch's hooks are out of the collector's sight), so an
    optimizer the program drops is collected, and its hooks with it (``_remove_hooks``)."""
    def hook(param):
        optimizer = optimizer_ref()
        if optimizer is not None:
            optimizer._on_grad_ready(param)
    return hook


def _remove_hooks(handles) -> None:
    for handle in handles:
        handle.remove()


def _check_update_rule(saved: dict | None, mine: dict) -> None:
    """ValueError, naming the options, if a checkpoint's update rule is not this optimizer's
    (its velocities or residuals would not fit, or would mean something else)."""
    if saved is None:   # saved before the rule was recorded: the state's own checks decide
        return
    differ = {name: (saved.get(name), mine[name]) for name in ("momentum_correction", "dense_params")
              if saved.get(name) != mine[name]}
    if differ:
        shown = ", ".join(f"{name}={was!r} there, {now!r} here" for name, (was, now) in differ.items())
        raise ValueError(f"the checkpoint was saved with another update rule ({shown}; recipe "
                         f"{saved.get('recipe')!r} there, {mine['recipe']!r} here): build the optimizer "
                         "with the options it was saved with to resume it")


@functools.cache
def _distributed_class(base: type) -> type:
    return type(base.__name__, (_LAGSOptimizer, base), {"__module__": __name__, "_wrapped_class": base})


def wrap(optimizer, collectives: Collectives, member: bool, named_parameters, compression,
         backward_passes_per_step: int, op: str, gradient_predivide_factor: float, num_groups: int, groups,
         sparse_as_dense: bool, lags_options: dict):
    """Re-class ``optimizer`` in place as a LAGS ``DistributedOptimizer`` exchanging over
    ``collectives`` (a front-end's ``DistributedOptimizer`` calls this; ``_lags_init`` has
    the arguments); on any error it is left exactly as it was."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _LAGSOptimizer):
        raise TypeError("this optimizer is already a lags_hvd.DistributedOptimizer")
    original_class, original_attributes = type(optimizer), set(vars(optimizer))
    optimizer.__class__ = _distributed_class(original_class)   # the same object, re-classed
    try:
        optimizer._lags_init(collectives, member, named_parameters, compression, backward_passes_per_step, op,
                             gradient_predivide_factor, num_groups, groups, sparse_as_dense, lags_options)
    except BaseException:   # leave the user's optimizer exactly as it was
        for added in set(vars(optimizer)) - original_attributes:
            delattr(optimizer, added)
        optimizer.__class__ = original_class
        raise
    return optimizer
