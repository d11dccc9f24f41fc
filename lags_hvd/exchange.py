"""What every exchange shares: its configuration, a started collective, the finite checks.

A bucket's exchange is started by its aggregation (``lags_hvd.aggregation``: the wire
format of each variant lives in its module) and returns a ``Pending`` at once;
``Pending.wait`` blocks. The collectives come from ``ExchangeConfig.collectives``
(``lags_hvd.collectives``: one interface, one module per backend). Every wait is bounded
(``ExchangeConfig.timeout``, the ``exchange_timeout`` option): a rank that waits longer
raises ``ExchangeTimeoutError`` naming the exchange, and a peer that died raises
``WorkerLostError``.

Every aggregation reduces as ``average`` says (Horovod's ``op``):

    average:  result = (f / P) * sum_p (x_p / f)     f = gradient_predivide_factor
    sum:      result = sum_p x_p

(for the sparse path with f == 1 the division by P is a plain division, so the
result matches a straightforward reference bit for bit). Horovod's ``compression``
applies to the values on the wire (e.g. ``Compression.fp16`` halves them); with
reduce_scatter twice, to each worker's entries and to the owners' sums, so a sum
is rounded once more and overflows fp16 at up to P times smaller entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .collectives import DEFAULT_TIMEOUT, Collectives, NoCompression

__all__ = [
    "ExchangeConfig",
    "Pending",
    "ExchangeStarted",
    "all_finite",
    "finite_flag",
    "DEFAULT_TIMEOUT",
]


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every entry is finite, exactly (one host read; for the rare path where
    ``finite_flag`` said no: its sum may have overflowed on finite entries)."""
    return bool(torch.isfinite(tensor).all())


def finite_flag(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor, on the tensor's device: True when the sum of the entries is
    finite, which holds whenever every entry is (a NaN or Inf entry makes the sum
    non-finite; a finite tensor whose sum overflows gives a false alarm that
    ``all_finite`` settles). One reduction, no host read."""
    return torch.isfinite(tensor.sum(dtype=torch.float64 if tensor.dtype == torch.float64 else torch.float32))


@dataclass(frozen=True)
class ExchangeConfig:
    """What every exchange of one optimizer shares."""

    collectives: Collectives
    average: bool = True  # Horovod's op=Average; False: op=Sum
    gradient_predivide_factor: float = 1.0
    compression: Any = NoCompression
    timeout: float | None = DEFAULT_TIMEOUT
    # the prefix of every collective's name, one per optimizer (``agreement.wire_namespace``):
    # collectives are matched by name, so two optimizers' exchanges must never share one
    namespace: str = "lags"

    def __post_init__(self):
        if self.gradient_predivide_factor != 1.0 and not self.average:
            raise ValueError("gradient_predivide_factor is only supported with op=hvd.Average")
        if not self.gradient_predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got {self.gradient_predivide_factor}")

    @property
    def world(self) -> int:
        """Workers in the group."""
        return self.collectives.size

    @property
    def rank(self) -> int:
        """This worker's rank in the group (what alltoall and allgather order by); asked only
        of a member (a rank outside a process set has none)."""
        return self.collectives.rank

    def prescale(self) -> float:
        return 1.0 / self.gradient_predivide_factor if self.average else 1.0

    def postscale(self) -> float:
        return self.gradient_predivide_factor if self.average else 1.0


@dataclass(frozen=True)
class ExchangeStarted:
    """What an exchange observer is told when a unit's exchange starts (instrumentation:
    ``DistributedOptimizer.exchange_observers``). ``values`` and ``indices`` are this
    rank's contribution as handed to the collective (``indices`` None for a dense
    allreduce, whose ``values`` is the whole tensor); copy them to keep them."""

    name: str
    numel: int
    values: torch.Tensor
    indices: torch.Tensor | None
    pending: Pending

    @property
    def sparse(self) -> bool:
        return self.indices is not None


class Pending:
    """A started exchange: ``collect()`` waits for the network (bounded, ``Collectives.wait``),
    ``finish()`` turns what arrived into the result (what the aggregation that started it
    says); ``wait()`` does both."""

    def __init__(self, handle, finish, name: str, config: ExchangeConfig):
        self._handle = handle
        self._finish = finish
        self._name, self._config = name, config

    def finish(self, arrived):
        return self._finish(arrived)

    def done(self) -> bool:
        return self._config.collectives.done(self._handle)

    def collect(self):
        return self._config.collectives.wait(self._handle, f"the exchange {self._name!r}", self._config.timeout)

    def wait(self):
        return self.finish(self.collect())
