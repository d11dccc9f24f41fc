"""The errors lags_hvd raises when ranks cannot go on together.

Each one is raised on every rank that can still tell (a dead or stalled rank
cannot), with a message naming the exchange, the iteration and the ranks
involved, so a job ends loudly instead of hanging or drifting apart.
"""

from __future__ import annotations

__all__ = ["WorkerLostError", "ExchangeTimeoutError", "RanksDisagreeError", "OutOfStepError"]


class WorkerLostError(RuntimeError):
    """A collective failed because another worker died or left the job."""


class ExchangeTimeoutError(WorkerLostError):
    """A collective waited longer than ``exchange_timeout`` for ranks that never joined it
    (stalled, stuck in other work, or calling ``step()`` fewer times than this rank)."""


class RanksDisagreeError(ValueError):
    """Ranks built ``DistributedOptimizer`` with settings that must match but do not
    (the model, k or density, options that change the math), or one rank refused its own."""


class OutOfStepError(RuntimeError):
    """At run time, ranks reached the same exchange from different iterations, with and
    without a backward pass, with different k, or after changing which parameters train."""
