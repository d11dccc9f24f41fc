"""The errors lags_hvd raises when ranks cannot go on together.

Each one is raised on every rank that can still tell (a dead or stalled rank
cannot), with a message naming the exchange, the iteration and the ranks
involved, so a job ends loudly instead of hanging or drifting apart.
"""

from __future__ import annotations

__all__ = ["WorkerLostError", "ExchangeTimeoutError", "RanksDisagreeError", "OutOfStepError", "FailureLatch"]


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


class FailureLatch:
    """An optimizer's failure, latched: an error in a backward hook or in ``synchronize()``
    leaves that iteration's gradients holding residuals and its exchanges uncompletable, so
    going on would add the residuals twice; every later use is refused with the cause."""

    def __init__(self):
        self.cause: str | None = None

    def latch(self, error: BaseException) -> None:
        self.cause = f"{type(error).__name__}: {str(error)[:200]}"

    def check(self, iteration: int) -> None:
        """RuntimeError, naming the cause and what to do, once latched."""
        if self.cause:
            raise RuntimeError(
                f"lags_hvd: this optimizer failed at iteration {iteration} ({self.cause}). That "
                "iteration's gradients already hold residuals and its exchanges cannot be completed, so it "
                "cannot go on: stop this process and restart from the last checkpoint (the residuals in "
                "state_dict() are still those of the last completed step)"
            )
