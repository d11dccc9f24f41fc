"""What a ``DistributedOptimizer`` tells about itself: read-only properties, nothing that changes it."""

from __future__ import annotations

from collections.abc import Callable

from .exchange import ExchangeStarted
from .options import LAGSOptions
from .profiling import BackwardTimer
from .state import LAGSState

__all__ = ["IntrospectionMixin"]


class IntrospectionMixin:
    """The read-only properties of ``optimizer._LAGSOptimizer`` (one concern, one module)."""

    @property
    def exchange_observers(self) -> list[Callable[[ExchangeStarted], None]]:
        """Callables told of every exchange as it starts (``exchange.ExchangeStarted``: the
        unit, this rank's values and indices, the pending handle), in the thread that starts
        it: instrumentation for tests and profilers. Empty by default (nothing is called)."""
        return self._context.observers

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
        return self._loops.adaptive.plan if self._loops.adaptive else None

    @property
    def adaptive_settled(self) -> bool:
        """Adaptive mode: a plan has been verified (or the loop fell back); fixed mode: True."""
        return self._loops.adaptive.settled if self._loops.adaptive else True

    @property
    def buckets_settled(self) -> bool:
        """``buckets="auto"``: the buckets have been planned; otherwise True."""
        return self._loops.auto_buckets is None or self._loops.auto_buckets.planned

    @property
    def bucket_history(self) -> list[dict]:
        """``buckets="auto"``'s decision (iteration, buckets, fitted engine costs, predicted
        times of per-layer, one bucket and the chosen plan), identical on every rank."""
        return self._loops.auto_buckets.history if self._loops.auto_buckets else []

    @property
    def adaptive_history(self) -> list[dict]:
        """The adaptive loop's decisions (plan, keep, back off), identical on every rank."""
        return self._loops.adaptive.history if self._loops.adaptive else []

    overlap: bool
    """True (default): each unit's exchange starts from its backward hook, overlapping the
    rest of backprop. False: hooks only take note, and ``synchronize()`` starts every
    exchange after backprop (the same messages without pipelining; a baseline)."""

    @property
    def iteration_under_way(self) -> bool:
        """Whether an iteration has begun (a backward hook fired) and ``synchronize()`` has not
        ended it; everything of an iteration is dropped when it ends, however it ends."""
        return self._engine.under_way

    @property
    def exchanges_in_flight(self) -> int:
        """Exchanges started by this iteration's hooks and not yet synchronized."""
        return len(self._engine.in_flight)

    @property
    def traffic(self) -> dict[str, dict[str, int]]:
        """Per sparse unit, the bytes this worker sent to and received from the other ranks
        in its last exchange (what the aggregation moves, by its algorithm: an allgather
        sends and receives its message P-1 times; ``regions.traffic`` for reduce_scatter)."""
        return {name: {"sent": sent, "received": received} for name, (sent, received) in self._engine.traffic.items()}

    @property
    def cuda_graphs(self) -> dict[str, str]:
        """Per bucket replayed from CUDA graphs (``cuda_graphs=True``) at its k in force: what
        its graphs hold, ``"accumulate and select"`` (the hook's whole device work: the rule's
        where it can be replayed, the accumulate, the selection, the packing), or ``"select"``
        (the selection and packing alone) where its gradients did not stay at the same
        addresses (``lags_hvd.capture``)."""
        return {
            name: "accumulate and select" if bucket.graphs.accumulates else "select"
            for name, bucket in self._engine.buckets.items()
            if bucket.graphs is not None and len(bucket.graphs)
        }

    @property
    def backward_timer(self) -> BackwardTimer:
        """Hook timestamps and selection times of recent iterations."""
        return self._engine.timer
