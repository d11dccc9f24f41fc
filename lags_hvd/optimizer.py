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
"""
from __future__ import annotations

import functools
import math
import pickle
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError

from . import selection
from .assumption import delta
from .adaptive import AdaptiveDensity
from .exchange import DenseAllreduce, ExchangeConfig, Pending, SparseAllgather, all_finite
from .layout import ExchangeUnit, build_units, name_parameters, small_tensor_groups
from .options import LAGSOptions
from .profiling import BackwardTimer
from .residual import ResidualMemory

__all__ = ["DistributedOptimizer", "TopKDistributedOptimizer", "LAGSState", "WorkerLostError"]

_STATE_KEY = "lags"


class WorkerLostError(RuntimeError):
    """An exchange failed because another worker died or left the job."""


@dataclass
class LAGSState:
    """What LAGS-SGD carries from one iteration to the next, besides the wrapped optimizer's state.

    Attributes:
        units: the exchange units, in name order (identical on every rank).
        k: entries each unit sends per worker; ``k == numel`` means a dense allreduce.
        residuals: this rank's error-feedback memory (``eps``), one buffer per sparse unit.
        exchange_lr: per unit, the learning rate of its last exchange (only tracked with
            ``lr_scaled_residual``).
        iteration: number of completed synchronizations.
    """

    units: list[ExchangeUnit]
    k: dict[str, int] = field(default_factory=dict)
    residuals: ResidualMemory = field(default_factory=ResidualMemory)
    exchange_lr: dict[str, float] = field(default_factory=dict)
    iteration: int = 0

    def is_dense(self, unit: ExchangeUnit) -> bool:
        return self.k[unit.name] == unit.numel

    def set_densities(self, densities: dict[str, float]) -> None:
        self.set_k({u.name: selection.k_for_density(densities[u.name], u.numel) for u in self.units})

    def set_k(self, k: dict[str, int]) -> None:
        """Set every unit's k; allocate residuals for units that become sparse."""
        units = {u.name: u for u in self.units}
        if set(k) != set(units) or any(not 1 <= int(v) <= units[n].numel for n, v in k.items()):
            raise ValueError(f"k must give every unit a value in [1, numel]; got {sorted(k)[:5]}... "
                             f"for units {sorted(units)[:5]}...")
        for name, value in k.items():
            self.k[name] = int(value)
            if value < units[name].numel and name not in self.residuals:
                self.residuals.register(name, units[name].numel, units[name].dtype, units[name].device)

    def state_dict(self) -> dict:
        return {"residuals": self.residuals.state_dict(), "exchange_lr": dict(self.exchange_lr),
                "iteration": self.iteration, "k": dict(self.k)}

    def check_state_dict(self, saved: dict) -> None:
        """Raise ValueError unless ``saved`` fits these units (nothing is modified)."""
        if not isinstance(saved, dict) or "residuals" not in saved:
            raise ValueError("the optimizer state has no usable 'lags' entry (residuals missing)")
        self.residuals.check_state_dict(saved["residuals"])

    def load_state_dict(self, saved: dict) -> None:
        self.check_state_dict(saved)
        self.residuals.load_state_dict(saved["residuals"])
        self.exchange_lr = dict(saved.get("exchange_lr", {}))
        self.iteration = int(saved.get("iteration", 0))


class _LAGSOptimizer:
    """Mixin placed in front of the wrapped optimizer's class; see ``DistributedOptimizer``."""

    # ------------------------------------------------------------------ set-up
    def _lags_init(self, named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set,
                   options: LAGSOptions):
        names = name_parameters(self.param_groups, named_parameters)
        if sum(map(bool, (num_groups, groups is not None, options.min_unit_numel))) > 1:
            raise ValueError("pass only one of num_groups, groups and min_unit_numel")
        trainable = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if num_groups:
            ordered = sorted(trainable, key=lambda p: names[p])
            size = math.ceil(len(ordered) / num_groups)
            groups = [ordered[i:i + size] for i in range(0, len(ordered), size)]
        if options.min_unit_numel:
            groups = small_tensor_groups(self.param_groups, options.min_unit_numel)
        units = build_units(self.param_groups, names, groups)
        if not units:
            raise ValueError("the optimizer has no trainable parameters to exchange")

        _check_same_model_everywhere(units, process_set)
        self._options = options
        self._lags = LAGSState(units=units)
        config = ExchangeConfig(op=op, gradient_predivide_factor=gradient_predivide_factor,
                                compression=compression, process_set=process_set)
        if options.adaptive:
            self._adaptive = AdaptiveDensity(options, process_set, units)
            self._lags.set_densities({u.name: options.min_density for u in units})
            self._adaptive.set_floor(self._lags.k)
        else:
            self._adaptive = None
            self._lags.set_densities(self._fixed_densities(options))
        self._select = selection.get_selector(options.selector)
        self._timer = BackwardTimer()
        self._sparse_exchange = SparseAllgather(config)
        self._dense_exchange = DenseAllreduce(config)
        self._sparse_as_dense = sparse_as_dense
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        self.backward_passes_per_step = backward_passes_per_step
        self._unit_of = {p: unit for unit in units for p in unit.params}
        self._passes_left = {p: backward_passes_per_step for p in self._unit_of}
        self._not_ready = {unit.name: set(unit.params) for unit in units}
        self._pending: dict[str, Pending] = {}
        self._monitored: dict[str, torch.Tensor] = {}   # acc copies on monitored iterations
        self._staged_lr: dict[str, float] = {}  # lr of this iteration's exchanges, until commit
        self._scale: float | None = None        # the grad_scaler's scale this iteration
        self._skip_step = False
        self.skipped_steps = 0
        self.assumption_log: list[dict] = []
        self._synchronized = False
        self._should_synchronize = True
        self.overlap = True
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._make_hook(p))
                              for p in self._unit_of]

    def _fixed_densities(self, options: LAGSOptions) -> dict[str, float]:
        unknown = sorted(set(options.layer_densities) - {u.name for u in self._lags.units})
        if unknown:
            raise ValueError(f"layer_densities names no exchange unit: {unknown}")
        return {u.name: options.layer_densities.get(u.name, options.density) for u in self._lags.units}

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
        if not waiting and self.overlap:
            self._launch(unit)

    def _launch(self, unit: ExchangeUnit, from_hook: bool = True) -> None:
        """Select this unit's entries, stage its residual and start its exchange (no waiting)."""
        ready_at = self._timer.now()
        grad = self._unit_grad(unit)
        state = self._lags
        scale = self._loss_scale()
        if state.is_dense(unit):
            if unit.name in state.residuals:
                state.residuals.drain_into(unit.name, grad, scale)
            self._pending[unit.name] = self._dense_exchange.start(unit.name, grad)
        else:
            k, acc = state.k[unit.name], None
            if all_finite(grad):
                acc = state.residuals.accumulate(unit.name, grad, grad_scale=1.0 / scale,
                                                 residual_scale=self._residual_rescale(unit))
                if self._monitoring():
                    self._monitored[unit.name] = acc * scale
                values, indices = self._select(acc, k)
                values = values * scale if scale != 1.0 else values
            else:  # nothing is staged; NaN values tell every rank to skip this step
                values = torch.full((k,), math.nan, dtype=grad.dtype, device=grad.device)
                indices = torch.arange(k, device=grad.device)
            self._pending[unit.name] = self._sparse_exchange.start(unit.name, values, indices, unit.numel)
            if acc is not None:
                state.residuals.retain(unit.name, acc, indices)   # after packing the values
        if from_hook:
            self._timer.unit_ready(unit.name, ready_at, self._timer.now() - ready_at)

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

    def _unit_grad(self, unit: ExchangeUnit) -> torch.Tensor:
        for p, name in zip(unit.params, unit.param_names):
            if p.grad is not None and p.grad.is_sparse:
                if not self._sparse_as_dense:
                    raise TypeError(f"parameter {name!r} has a torch.sparse gradient (e.g. from "
                                    "nn.Embedding(sparse=True)); pass sparse_as_dense=True to "
                                    "densify it before selection")
                p.grad = p.grad.to_dense()
        return unit.flat_grad()

    def _residual_rescale(self, unit: ExchangeUnit) -> float:
        """With ``lr_scaled_residual``: eta_{t-1} / eta_t, which keeps eps in the paper's
        lr-scaled space when the lr changes (eta_t is recorded when the step commits)."""
        if not self._options.lr_scaled_residual:
            return 1.0
        lr = float(self.param_groups[unit.group_index]["lr"])
        if not lr > 0:
            raise ValueError(f"lr_scaled_residual needs a positive learning rate, got {lr} "
                             f"for {unit.name!r}")
        self._staged_lr[unit.name] = lr
        previous = self._lags.exchange_lr.get(unit.name, lr)
        return previous / lr if previous != lr else 1.0

    # ------------------------------------------------------------------ Horovod API
    def synchronize(self) -> None:
        """Finish every unit's exchange and write the merged gradients into ``p.grad``.

        Units whose hooks did not fire on this rank (parameters unused here) are
        exchanged now with a zero gradient, so every rank takes part in every
        collective and none waits forever.
        """
        for unit in self._lags.units:
            if unit.name not in self._pending:
                self._launch(unit, from_hook=False)
        units = {unit.name: unit for unit in self._lags.units}
        wait = merge = 0.0
        applied = {}
        self._skip_step = False
        try:
            for name, pending in self._pending.items():
                started = self._timer.now()
                try:
                    arrived = pending.collect()
                except HorovodInternalError as lost:
                    raise WorkerLostError(
                        f"lags_hvd: the exchange of {name!r} at iteration {self._lags.iteration} failed: "
                        "a worker died or left the job; this rank stops too (restart from the last "
                        f"checkpoint). Horovod said: {str(lost)[:300]}") from lost
                collected = self._timer.now()
                applied[name] = pending.finish(arrived)
                wait, merge = wait + collected - started, merge + self._timer.now() - collected
            broken = sorted(name for name, pending in self._pending.items() if not pending.finite)
            if broken:
                self._skip_nonfinite_step(broken)
            else:
                self._lags.residuals.commit()
                self._lags.exchange_lr.update(self._staged_lr)
                if self._monitored:
                    self._measure_assumption(units, applied)
            for name, result in applied.items():
                units[name].write_grad(result)
        finally:
            self._pending.clear()
            self._monitored.clear()
            self._lags.residuals.discard()   # whatever was not committed
            self._staged_lr.clear()
            self._scale = None
            self._reset_pass_counters()
        self._timer.end_iteration(wait, merge)
        self._lags.iteration += 1
        if self._adaptive:
            k = self._adaptive.after_synchronize(self._lags.iteration, self._timer)
            if k is not None:
                self._lags.set_k(k)
        self._synchronized = True

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

    def _measure_assumption(self, units, applied) -> None:
        """delta per sparse unit: the dense average of acc against what was applied."""
        averages = {name: self._dense_exchange.start(f"monitor.{name}", acc)
                    for name, acc in sorted(self._monitored.items())}
        self.assumption_log.append({"iteration": self._lags.iteration, "delta": {
            name: delta(pending.wait(), applied[name], self._lags.k[name], units[name].numel)
            for name, pending in averages.items()}})

    def _reset_pass_counters(self) -> None:
        for p in self._passes_left:
            self._passes_left[p] = self.backward_passes_per_step
        for unit in self._lags.units:
            self._not_ready[unit.name] = set(unit.params)

    def set_backward_passes_per_step(self, passes: int) -> None:
        if passes < 1:
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
        if self._should_synchronize and self._options.grad_scaler is not None:
            raise RuntimeError(
                "with grad_scaler, synchronize before the GradScaler reads the gradients:\n"
                "    scaler.scale(loss).backward()\n    optimizer.synchronize()\n"
                "    scaler.unscale_(optimizer)  # optional, e.g. for clipping\n"
                "    with optimizer.skip_synchronize():\n        scaler.step(optimizer)\n"
                "    scaler.update()")
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called after optimizer.synchronize() without "
                              "optimizer.skip_synchronize(): the gradients are exchanged twice",
                              stacklevel=2)
            self.synchronize()
        self._synchronized = False
        if self._skip_step:
            self._skip_step = False
            return None
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
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
        """The wrapped optimizer's state plus this rank's LAGS state under ``'lags'``."""
        state = super().state_dict()
        state[_STATE_KEY] = self._lags.state_dict()
        state[_STATE_KEY]["world_size"] = self._sparse_exchange.config.world
        return state

    def load_state_dict(self, state_dict) -> None:
        """Restore the wrapped optimizer's state and this rank's residuals.

        A state without ``'lags'`` (e.g. from a plain optimizer) leaves the residuals
        as they are. A state saved with a different number of workers resets them to
        zero with a warning: a residual is one worker's unsent gradient and has no
        counterpart on a different set of workers.
        """
        if self._pending:
            raise RuntimeError("load_state_dict() while exchanges are in flight; call it before "
                               "backward or after step()")
        state_dict = dict(state_dict)
        saved = state_dict.pop(_STATE_KEY, None)
        world = self._sparse_exchange.config.world
        reset = saved is not None and saved.get("world_size", world) != world
        if reset:
            warnings.warn(f"checkpoint was saved with {saved['world_size']} workers, this run "
                          f"has {world}: residuals start from zero", stacklevel=2)
        elif saved is not None:
            if self._adaptive and "k" in saved:
                self._lags.set_k(saved["k"])  # the plan in force when saved; may add residuals
                self._adaptive.resume(int(saved.get("iteration", 0)))
            self._lags.check_state_dict(saved)  # before anything else is modified
        super().load_state_dict(state_dict)
        if reset:
            self._lags.residuals.reset()
        elif saved is not None:
            self._lags.load_state_dict(saved)
        self._synchronized = False
        self._should_synchronize = True
        self._reset_pass_counters()


def _allgather_object(obj, name: str, process_set) -> list:
    """Every rank's ``obj``, in rank order (Horovod 0.28's allgather_object has no process set)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = hvd.allgather(torch.tensor([payload.numel()]), name=f"{name}.sizes", process_set=process_set)
    gathered = hvd.allgather(payload, name=f"{name}.bytes", process_set=process_set)
    return [pickle.loads(chunk.numpy().tobytes()) for chunk in torch.split(gathered, sizes.tolist())]


def _check_same_model_everywhere(units, process_set) -> None:
    """Compare every rank's parameters (names, shapes, dtypes, in unit order) before any
    exchange: each rank sees all digests, so all raise the same error and none hangs."""
    digest = [(name, tuple(p.shape), str(p.dtype)) for unit in units
              for name, p in zip(unit.param_names, unit.params)]
    digests = _allgather_object(digest, "lags.model_digest", process_set)
    for rank, other in enumerate(digests):
        if other == digests[0]:
            continue
        for i, (mine, theirs) in enumerate(zip(digests[0], other)):
            if mine != theirs:
                raise ValueError(f"the model differs across ranks: parameter #{i} is {mine} on rank 0 "
                                 f"but {theirs} on rank {rank} of the process set")
        raise ValueError(f"the model differs across ranks: rank 0 has {len(digests[0])} trainable "
                         f"parameters, rank {rank} has {len(other)}")


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
        process_set: the Horovod process set whose ranks exchange.

    Keyword-only LAGS options (``lags_hvd.options.LAGSOptions`` explains each):
        density (0.001, a number in (0, 1] or ``"adaptive"``), layer_densities,
        selector, lr_scaled_residual, grad_scaler, min_unit_numel, monitor_every, and for the
        adaptive mode
        min_density, max_density, warmup_iterations, replan_every, network_profile,
        plan_slack, plan_report_dir, verbose.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _LAGSOptimizer):
        raise TypeError("this optimizer is already a lags_hvd.DistributedOptimizer")
    options = LAGSOptions(**lags_options)
    original_class, original_attributes = type(optimizer), set(vars(optimizer))
    optimizer.__class__ = _distributed_class(original_class)   # the same object, re-classed
    try:
        optimizer._lags_init(named_parameters, compression, backward_passes_per_step, op,
                             gradient_predivide_factor, num_groups, groups, sparse_as_dense,
                             process_set, options)
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
    if density == "adaptive" or lags_options.get("min_unit_numel"):
        raise ValueError("TopKDistributedOptimizer takes a fixed density and one global unit")
    everything = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    return DistributedOptimizer(optimizer, named_parameters, compression, backward_passes_per_step, op,
                                gradient_predivide_factor, 0, [everything], sparse_as_dense, process_set,
                                density=density, **lags_options)
