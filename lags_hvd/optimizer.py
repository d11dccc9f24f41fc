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
import warnings
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .adaptive import PlanningLoops
from .agreement import agree_on_settings, release_namespace, settings_to_agree
from .checkpointing import CheckpointMixin
from .checks import check_count
from .collectives import DEFAULT_TIMEOUT, Collectives, NoCompression
from .consensus import average_models
from .density import param_kinds
from .engine import Engine, Outcome, engine_context
from .errors import ExchangeTimeoutError, FailureLatch, OutOfStepError, WorkerLostError
from .introspection import IntrospectionMixin
from .layout import first_units, name_parameters
from .options import LAGSOptions
from .uneven import live, register
from .updates import unscale_for_fused_step

__all__ = ["StepPhase", "Wiring", "wrap"]

HOROVOD_STEP_WARNING = (
    "optimizer.step() called without optimizer.skip_synchronize() context after optimizer.synchronize()."
)
"""Horovod's own warning sentence, kept verbatim as the start of ours (scripts match it)."""


@dataclass(frozen=True)
class Wiring:
    """What a front-end hands the optimizer: the group that exchanges and whether this rank
    is in it, and ``hvd.DistributedOptimizer``'s arguments (``op``: "average", "sum", or
    the name of an op lags_hvd does not support, refused with the others' agreement)."""

    collectives: Collectives
    member: bool
    named_parameters: Any = None
    compression: Any = NoCompression
    backward_passes_per_step: int = 1
    op: str = "average"
    gradient_predivide_factor: float = 1.0
    num_groups: int = 0
    groups: Any = None
    sparse_as_dense: bool = False


@dataclass
class StepPhase:
    """Where a rank stands between two steps, which decides what ``step()`` does.

    Attributes:
        merged: this iteration's exchanges are merged into the gradients, not yet applied.
        skip: that merge held NaN or Inf: its step is skipped on every rank.
        exchange_on_step: ``step()`` synchronizes first (False inside ``skip_synchronize()``).
        plan_due: a merge was made: the next plan (buckets, k) is made once it is applied, before
            the next exchange starts.
        planners_may_broadcast: no rank sat in ``join()`` during that merge.
    """

    merged: bool = False
    skip: bool = False
    exchange_on_step: bool = True
    plan_due: bool = False
    planners_may_broadcast: bool = True

    def merge(self, outcome: Outcome) -> None:
        """``synchronize()`` merged an iteration (``outcome``: the engine's account of it)."""
        self.merged, self.skip = True, bool(outcome.nonfinite)
        self.plan_due, self.planners_may_broadcast = True, not outcome.joined

    def apply(self) -> bool:
        """The merge is consumed by a step: whether its update is to be applied (not skipped)."""
        applies = not self.skip
        self.merged = self.skip = False
        return applies

    def restart(self) -> None:
        """A loaded state: no merge pending, and its plan stands."""
        self.merged, self.skip, self.exchange_on_step = False, False, True
        self.plan_adopted()

    def plan_adopted(self) -> None:
        """A plan from a checkpoint or another rank stands: none is due."""
        self.plan_due = False


class _LAGSOptimizer(CheckpointMixin, IntrospectionMixin):
    """Mixin placed in front of the wrapped optimizer's class; see ``DistributedOptimizer``."""

    _owns_grads = True  # its own hooks report the gradients, .grad views the merge (not so under ``ddp``)
    _grad_scaler_watch = True  # False where the only GradScaler is known (Lightning's precision plugin)
    _in_lags_step = False  # inside lags_hvd's ``step()`` (``_marked_lags_step``)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """``torch.amp.GradScaler``'s question (Lightning's too): does ``step()`` unscale by itself?
        GradScaler then leaves ``.grad`` scaled and sets ``grad_scale`` and ``found_inf`` on the
        optimizer before calling ``step()``. Yes where the wrapped optimizer does (``fused=True``),
        and where no ``grad_scaler`` was passed: a GradScaler stepping this optimizer then shows
        itself in ``step()``, which refuses it (``_refuse_an_unpassed_grad_scaler``)."""
        if vars(self).get("_step_supports_amp_scaling", False):
            return True
        options = vars(self).get("_options")
        member = vars(self).get("_member", False)
        return bool(member and self._grad_scaler_watch and options is not None and options.grad_scaler is None)

    @_step_supports_amp_scaling.setter
    def _step_supports_amp_scaling(self, value: bool) -> None:
        vars(self)["_step_supports_amp_scaling"] = value  # the wrapped optimizer's own answer

    def _refuse_an_unpassed_grad_scaler(self) -> None:
        """A GradScaler stepping this optimizer without having been passed as ``grad_scaler``
        (it set ``found_inf``): the residuals were kept in the scale of the iteration that made
        them, and a scale that grows or backs off would misweigh them. Refused before anything
        is stepped, on every rank that steps so, with GradScaler's two attributes removed."""
        if self._options.grad_scaler is not None or "found_inf" not in vars(self):
            return
        _drop_grad_scaler_handoff(self)
        raise RuntimeError(
            "a torch.amp.GradScaler is stepping this lags_hvd optimizer, but was not passed to it: the "
            "residuals would keep the loss scale of the iteration that made them, and be misweighed "
            "whenever the scale changes. Pass it when wrapping, DistributedOptimizer(..., grad_scaler=scaler) "
            "(LAGSHookState(..., grad_scaler=scaler) under DDP), and step as the README's mixed-precision "
            "example does"
        )

    # ------------------------------------------------------------------ set-up
    def _lags_init(self, wiring: Wiring, lags_options: dict):
        """Validate locally, agree with every rank (one collective), then wire the hooks.

        A rank whose own validation fails still takes part in the agreement, so the others
        raise a clear error instead of waiting for it."""
        self._member = wiring.member
        options, settings, error = None, None, None
        if lags_options.get("buckets") is None and (wiring.num_groups or wiring.groups is not None):
            lags_options = {**lags_options, "buckets": "layer"}  # the user's groups are the buckets
        try:
            options = LAGSOptions(**lags_options)
            self._configure(options, wiring)
            settings = settings_to_agree(
                self._engine.units,
                self.lags_state.k,
                self._options,
                self._context,
                wiring,
                self._wrapped_class,
                self.param_groups,
            )
        except (ValueError, TypeError) as refused:
            error = refused
        try:
            if wiring.member:  # non-members exchange nothing, as with Horovod: they step locally
                timeout = options.exchange_timeout if options else DEFAULT_TIMEOUT
                agree_on_settings(settings, error, wiring.collectives, timeout)
            elif error is not None:
                raise error
        except BaseException:
            if "_context" in self.__dict__:  # refused after taking its collectives' names: give them back
                release_namespace(self._context.config.namespace)
            raise
        hook = _weak_hook(weakref.ref(self))
        params = self._engine.params if wiring.member and self._owns_grads else []
        self._hook_handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
        self.register_step_pre_hook(_refuse_a_step_around_lags)
        weakref.finalize(self, _remove_hooks, self._hook_handles)
        register(self)

    def _configure(self, options: LAGSOptions, wiring: Wiring) -> None:
        """Everything that needs no communication: units, k, exchanges; raises on bad input."""
        if isinstance(self, torch.optim.LBFGS):
            raise TypeError(
                "LBFGS evaluates its closure several times per step, and every evaluation's "
                "gradients would need an exchange of their own: it cannot be wrapped"
            )
        self._names = names = name_parameters(self.param_groups, wiring.named_parameters)
        check_count(wiring.backward_passes_per_step, "backward_passes_per_step", 1)
        self._options = options
        kinds = param_kinds(self.param_groups, names, options)
        units = first_units(self.param_groups, names, wiring.num_groups, wiring.groups, options.buckets, kinds)
        self._context = engine_context(
            options, wiring, units, self.param_groups, names, self._wrapped_class, _live_groups(weakref.ref(self))
        )
        self._options = options = self._context.options  # with what the update rule resolves
        self._engine = Engine(units, self._context)
        self._loops = PlanningLoops(options, self._engine, names)
        self._phase = StepPhase()
        self._failure = FailureLatch()  # latched by an error in a hook or synchronize()
        self.skipped_steps = 0
        self.assumption_log: list[dict] = []
        self.grad_norm: torch.Tensor | None = None  # max_grad_norm: the last merged norm, unclipped
        self.overlap = True

    # ------------------------------------------------------------------ backward hooks
    def _on_grad_ready(self, p) -> None:
        with _InBackward(self):
            self._plan_next()  # a synchronize() that no step() followed planned nothing yet
            self._engine.gradient_ready(p, self.overlap)

    def _check_usable(self) -> None:
        self._failure.check(self.lags_state.iteration)

    def _abandon(self, error: BaseException) -> OutOfStepError | None:
        """An error in a hook: the optimizer fails (``FailureLatch``) and drops the iteration's
        exchanges. Where a peer was lost after this iteration's step check arrived out of step,
        returns that ``OutOfStepError``, the cause to raise in the error's place."""
        verdict = self._context.verdict() if isinstance(error, WorkerLostError) else None
        self._failure.latch(verdict or error)
        self._engine.abandon()
        return verdict

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
            self._phase.merged = True
            return
        self._check_usable()
        try:
            self._synchronize()
        except BaseException as error:
            self._failure.latch(error)
            if isinstance(error, (WorkerLostError, ExchangeTimeoutError)):  # the cause may be crossed checks
                crossed = next((e for o in live() if o is not self and (e := o._context.token.crossed())), None)
                if crossed is not None:
                    raise crossed from error
            raise

    def _synchronize(self) -> None:
        outcome = self._engine.finish(bind=self._owns_grads)
        self.grad_norm = outcome.grad_norm
        if outcome.nonfinite:
            self._skip_nonfinite_step(outcome)
        elif outcome.delta is not None:
            self.assumption_log.append({"iteration": outcome.iteration, "delta": outcome.delta})
        self._phase.merge(outcome)

    def _plan_next(self) -> None:
        """Make the pending plan (``PlanningLoops.after_synchronize``): after the step, so that
        the step applies this iteration's merge with the buckets and memories that made it."""
        if self._phase.plan_due:
            self._phase.plan_due = False
            self._engine = self._loops.after_synchronize(self._engine, self._phase.planners_may_broadcast)

    def _adopt_plan(self, saved: dict) -> Callable[[], None]:
        """The buckets (and their planned flag) of a saved or broadcast state made this
        optimizer's (``PlanningLoops.adopt``); returns the undo (ValueError changes nothing)."""
        engine = self._engine
        self._engine, undo_loops = self._loops.adopt(engine, saved)

        def undo() -> None:
            self._engine = engine
            undo_loops()

        return undo

    def _skip_nonfinite_step(self, outcome: Outcome) -> None:
        """NaN or Inf reached a merged gradient (every rank sees the same ones): this
        iteration is dropped everywhere. The staged residuals are discarded, so every
        residual is exactly what it was before the iteration; ``step()`` skips the
        update; ``p.grad`` keeps the non-finite merged values for inspection (and for
        a GradScaler, which then skips its step and lowers its scale)."""
        self.skipped_steps += 1
        if self._options.grad_scaler is None:  # with a GradScaler, overflows are routine
            warnings.warn(
                f"lags_hvd: non-finite gradient in {', '.join(outcome.nonfinite)} at iteration "
                f"{outcome.iteration}: the step is skipped on every rank and the "
                "residuals are left as they were",
                RuntimeWarning,
                stacklevel=3,
            )

    @torch.no_grad()
    def average_models(self) -> None:
        """Collective over every rank, where the update rule keeps each rank's residual in its
        parameters (``local_residual``, Adam correction's default): every rank's model made the
        ranks' average, the residuals zeroed (``consensus``). Call it after ``step()``, before
        evaluating or saving the final model; under the other rules it does nothing."""
        if not self._member or not self._context.rule.local_models:
            return
        self._check_usable()
        if (self._phase.merged and not self._phase.skip) or not self._engine.idle:
            raise RuntimeError(
                "average_models() inside an iteration (after backward or synchronize(), before step()): "
                "the residuals are this iteration's and the parameters not yet stepped; call it after step()"
            )
        average_models(self.lags_state, self._context)

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
        self._phase.exchange_on_step = False
        try:
            yield
        finally:
            self._phase.exchange_on_step = True

    def step(self, closure=None):
        """Exchange (unless inside ``skip_synchronize()``), then the wrapped optimizer's update.

        ``closure`` (torch's API: it zeroes the gradients, computes the loss and calls
        ``backward()``) runs first, so the gradients of its backward pass are the ones
        exchanged; the wrapped optimizer then steps without it, and the closure's loss is
        returned. (Horovod's optimizer hands the closure to the wrapped step after the
        exchange, so the update uses the closure's local, unexchanged gradients.)"""
        if not self._member:
            return self._wrapped_step(closure)
        self._check_usable()
        self._refuse_an_unpassed_grad_scaler()
        loss = self._run_closure(closure) if closure is not None else None
        phase = self._phase
        if phase.exchange_on_step and self._options.grad_scaler is not None:
            raise RuntimeError(
                "with grad_scaler, synchronize before the GradScaler reads the gradients:\n"
                "    scaler.scale(loss).backward()\n    optimizer.synchronize()\n"
                "    scaler.unscale_(optimizer)  # optional, e.g. for clipping\n"
                "    with optimizer.skip_synchronize():\n        scaler.step(optimizer)\n"
                "    scaler.update()"
            )
        if not phase.exchange_on_step and not phase.merged:
            raise RuntimeError(
                "optimizer.step() inside optimizer.skip_synchronize() without optimizer.synchronize() "
                "first: the gradients have not been exchanged, and this rank would step on its own. "
                "Call optimizer.synchronize() after backward and before skip_synchronize()"
            )
        if phase.exchange_on_step:
            if phase.merged:
                warnings.warn(
                    f"{HOROVOD_STEP_WARNING} lags_hvd: the gradients were already exchanged by "
                    "synchronize(); this step applies them without exchanging them again.",
                    stacklevel=2,
                )
            elif _initialises_state(self):  # under a correction the wrapped optimizer keeps no state
                return None if self._context.rule.steps_itself else self._wrapped_step()
            else:
                self.synchronize()
        self._apply()
        return loss

    def _apply(self) -> None:
        """The update of a synchronized iteration: the rule's own step, or the wrapped
        optimizer's on the merged gradients (none where the iteration's step is skipped)."""
        if self._phase.apply():
            if self._context.rule.steps_itself:
                self._rule_step()
            else:
                self._wrapped_step()
        self._plan_next()

    @torch.optim.Optimizer.profile_hook_step
    def _rule_step(self) -> None:
        """The update rule's own step on the merged gradients, inside torch's step hooks as the
        wrapped optimizer's step would be (``Optimizer.profile_hook_step``)."""
        self._engine.grads.take()  # what was done to .grad since the merge (unscale_, a clip, a hook)
        merged = self._engine.merged_units()
        unscale_for_fused_step(getattr(self, "grad_scale", None), [grad for _, grad, _ in merged])
        self._context.rule.step(self.param_groups, merged, self.lags_state)

    def _wrapped_step(self, closure=None):
        """The wrapped optimizer's own step (with torch's step hooks, on the merged gradients)."""
        step = self._wrapped_class.step
        return step(self) if closure is None else step(self, closure)

    def _run_closure(self, closure):
        """``step(closure)``: the closure's loss, its backward pass exchanging as any other."""
        if not self._phase.exchange_on_step or self._phase.merged:
            raise RuntimeError(
                "step(closure) after synchronize() or inside skip_synchronize(): the "
                "closure's backward pass would start exchanges this step does not wait "
                "for. Call step(closure) alone, or backward, synchronize() and step()"
            )
        with torch.enable_grad():
            return closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._check_usable()
        if self._engine.in_flight:
            shown = ", ".join(self._engine.in_flight[:5])
            raise RuntimeError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                f"optimizer.synchronize(): the exchanges in flight ({len(self._engine.in_flight)}: {shown}...) "
                "would race with it. If that backward pass was meant for another optimizer "
                "(a GAN's generator loss backpropagated through an "
                "unfrozen discriminator), freeze these parameters for it (requires_grad_(False)) or "
                "detach their output; otherwise call step() before zero_grad()"
            )
        return super().zero_grad(set_to_none=set_to_none)

    def __getstate__(self):
        """Refused: a copy would share this optimizer's hooks (on the model's parameters) and
        collective names, and pickling could not rebuild either."""
        raise TypeError(
            "a lags_hvd DistributedOptimizer cannot be copied or pickled (its hooks belong to "
            "the model's parameters, its exchanges to this object): save state_dict(), and "
            "wrap a new optimizer for the copy of the model with DistributedOptimizer()"
        )

    def add_param_group(self, param_group) -> None:
        """Refused after wrapping: the new parameters would have no exchange hooks, and
        their gradients would silently stay local to each rank."""
        if "_engine" in self.__dict__:
            raise RuntimeError(
                "add_param_group() after DistributedOptimizer() wrapped the optimizer: "
                "add every parameter group to the optimizer before wrapping it"
            )
        return super().add_param_group(param_group)


def _refuse_a_step_around_lags(optimizer: _LAGSOptimizer, args, kwargs) -> None:
    """Step pre-hook (torch runs it before a step changes anything): refused outside lags_hvd's
    ``step()``, that is where the wrapped optimizer's own step runs on its own. Code that took
    ``optimizer.step`` before the optimizer was wrapped still holds the wrapped optimizer's
    step, which would apply gradients that were never merged, or a merge that no LAGS step
    accounts for (Hugging Face Accelerate's optimizer does so under a GradScaler)."""
    if not optimizer._in_lags_step:
        _drop_grad_scaler_handoff(optimizer)
        raise RuntimeError(
            f"{optimizer._wrapped_class.__name__}.step() was called on a lags_hvd optimizer without lags_hvd's "
            "step(): code that took optimizer.step before the optimizer was wrapped still calls the old one "
            "(Hugging Face Accelerate does under mixed_precision='fp16'). Wrap the optimizer before handing "
            "it over: under Accelerate, build LAGSHookState(optimizer=optimizer, ...) after "
            "accelerator.prepare(model) and before accelerator.prepare(optimizer)"
        )


def _drop_grad_scaler_handoff(optimizer: _LAGSOptimizer) -> None:
    """Remove what a GradScaler stepping ``optimizer`` set on it (``grad_scale``, ``found_inf``),
    which GradScaler removes only after a step that returned: a refused step leaves none behind."""
    for name in ("grad_scale", "found_inf"):
        vars(optimizer).pop(name, None)


def _initialises_state(optimizer: _LAGSOptimizer) -> bool:
    """Whether this ``step()`` is Horovod's ``broadcast_optimizer_state`` initialising a
    fresh optimizer, not a training step, recognised by what that function does: on an
    optimizer without state, it replaces every trainable gradient by a new tensor of
    zeros and calls ``step()``, with no backward pass since the last step. (A rank with
    an empty batch zeroes the gradients it holds, views of the merged buffer, or leaves
    them None: that step exchanges.) Exchanging here would hang the ranks it runs on,
    those without state, so it steps locally: residuals, iteration and plan untouched."""
    if not optimizer._engine.idle or optimizer.state:
        return False
    grads = [(p, p.grad) for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    return all(grad is not None and not optimizer._engine.grads.holds(p, grad) and not grad.any() for p, grad in grads)


class _InBackward:
    """``with _InBackward(optimizer):`` around work on this iteration's gradients inside
    backward (a hook): refused once the optimizer failed; an error there fails it and drops the
    iteration's exchanges (``_abandon``), then propagates. A class, made once per hook: a
    generator-based context manager costs several times more."""

    __slots__ = ("optimizer",)

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def __enter__(self):
        self.optimizer._check_usable()

    def __exit__(self, kind, error, traceback):
        if kind is not None and (verdict := self.optimizer._abandon(error)) is not None:
            raise verdict from error
        return False


def _weak_hook(optimizer_ref: weakref.ref):
    """The backward hook of every parameter: it holds the optimizer weakly (a hook lives as
    long as its parameter, and torch's hooks are out of the collector's sight), so an
    optimizer the program drops is collected, and its hooks with it (``_remove_hooks``)."""

    def hook(param):
        optimizer = optimizer_ref()
        if optimizer is not None:
            optimizer._on_grad_ready(param)

    return hook


def _live_groups(optimizer_ref: weakref.ref):
    """The optimizer's ``param_groups`` read at each call: ``load_state_dict`` replaces the
    list and its dicts, so a reference kept at wrapping would go stale (held weakly, as the hooks)."""
    return lambda: optimizer_ref().param_groups


def _remove_hooks(handles) -> None:
    for handle in handles:
        handle.remove()


@functools.cache
def _distributed_class(base: type, front: type) -> type:
    return type(
        base.__name__,
        (front, base),
        {"__module__": __name__, "_wrapped_class": base, "step": _marked_lags_step(front.step)},
    )


def _marked_lags_step(step: Callable) -> Callable:
    """``front.step`` marked as lags_hvd's own step while it runs (``_refuse_a_step_around_lags``),
    and as hooked for torch, which would otherwise put its step hooks around it
    (``Optimizer._patch_step_function``, on ``load_state_dict``): they run around the update,
    once the gradients are merged (``_apply``), and not on a skipped step."""

    @functools.wraps(step)
    def lags_step(self, *args, **kwargs):
        self._in_lags_step = True
        try:
            return step(self, *args, **kwargs)
        finally:
            self._in_lags_step = False

    lags_step.hooked = True
    return lags_step


def wrap(optimizer, wiring: Wiring, lags_options: dict, front: type = _LAGSOptimizer):
    """Re-class ``optimizer`` in place as a LAGS ``DistributedOptimizer`` exchanging as
    ``wiring`` says (a front-end's ``DistributedOptimizer`` calls this; ``front``: the
    ``_LAGSOptimizer`` variant, DDP's in ``ddp``); on any error it is left exactly as it was."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _LAGSOptimizer):
        raise TypeError("this optimizer is already a lags_hvd.DistributedOptimizer")
    if "step" in vars(optimizer):  # an instance attribute would shadow the LAGS step
        patched = "an LR scheduler built before wrapping" if hasattr(optimizer.step, "_wrapped_by_lr_sched") else "code"
        raise TypeError(
            f"optimizer.step was replaced on this optimizer object by {patched}: that step would call the "
            "wrapped optimizer's own step and bypass the exchange (the first step would be local, and the "
            "second fail). Wrap the optimizer first, then build LR schedulers and anything else that "
            "patches step() on the DistributedOptimizer"
        )
    original_class, original_attributes = type(optimizer), set(vars(optimizer))
    optimizer.__class__ = _distributed_class(original_class, front)  # the same object, re-classed
    try:
        optimizer._lags_init(wiring, lags_options)
    except BaseException:  # leave the user's optimizer exactly as it was
        for added in set(vars(optimizer)) - original_attributes:
            delattr(optimizer, added)
        optimizer.__class__ = original_class
        raise
    return optimizer
