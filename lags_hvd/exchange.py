"""Exchange over Horovod: start a unit's collective now, collect its dense result later.

Two collectives, both asynchronous (``start`` returns at once; ``Pending.wait``
blocks):

* ``SparseAllgather``: every worker contributes its k selected ``(values, indices)``
  as one packed byte message (``sparse.pack``); the P messages are allgathered,
  unpacked and merged (``sparse.merge``) into a dense vector.
* ``DenseAllreduce``: Horovod's own in-place allreduce of the whole tensor, exactly
  what ``hvd.DistributedOptimizer`` does; used where a unit's density is 1.

Both reduce with ``op``:

    Average:  result = (f / P) * sum_p (x_p / f)     f = gradient_predivide_factor
    Sum:      result = sum_p x_p

(for the sparse path with f == 1 the division by P is a plain division, so the
result matches a straightforward reference bit for bit). Horovod's ``compression``
applies to the values on the wire (e.g. ``Compression.fp16`` halves them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import horovod.torch as hvd
import torch
from horovod.torch.mpi_ops import Average, Sum

from . import sparse

__all__ = ["ExchangeConfig", "SparseAllgather", "DenseAllreduce", "Pending", "SUPPORTED_OPS", "all_finite"]

SUPPORTED_OPS = (Average, Sum)


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every entry is finite, exactly. A NaN or Inf entry makes the sum non-finite,
    so a finite sum (one reduction, several times cheaper than ``isfinite().all()``)
    settles it; only a non-finite sum (or an overflowing one) takes the full check."""
    return math.isfinite(float(tensor.sum())) or bool(torch.isfinite(tensor).all())


@dataclass(frozen=True)
class ExchangeConfig:
    """What every exchange of one optimizer shares."""

    op: Any = Average
    gradient_predivide_factor: float = 1.0
    compression: Any = hvd.Compression.none
    process_set: Any = hvd.global_process_set

    def __post_init__(self):
        if self.op not in SUPPORTED_OPS:
            raise ValueError("lags_hvd supports op=hvd.Average and op=hvd.Sum; Adasum, Min, Max and "
                             f"Product have no meaning for a sparse sum (got {self.op!r})")
        if self.gradient_predivide_factor != 1.0 and self.op != Average:
            raise ValueError("gradient_predivide_factor is only supported with op=hvd.Average")
        if not self.gradient_predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got {self.gradient_predivide_factor}")

    @property
    def world(self) -> int:
        return self.process_set.size()

    def prescale(self) -> float:
        return 1.0 / self.gradient_predivide_factor if self.op == Average else 1.0

    def postscale(self) -> float:
        return self.gradient_predivide_factor if self.op == Average else 1.0


class Pending:
    """A started exchange: ``collect()`` waits for the network, ``finish()`` turns what
    arrived into the reduced dense flat tensor; ``wait()`` does both. After ``finish()``,
    ``finite`` says whether every entry of the result is finite."""

    def __init__(self, handle, finish):
        self._handle = handle
        self._finish = finish  # arrived -> (dense result, all entries finite)
        self.finite: bool | None = None

    def finish(self, arrived) -> torch.Tensor:
        dense, self.finite = self._finish(arrived)
        return dense

    def done(self) -> bool:
        return hvd.poll(self._handle)

    def collect(self):
        return hvd.synchronize(self._handle)

    def wait(self) -> torch.Tensor:
        return self.finish(self.collect())


class SparseAllgather:
    def __init__(self, config: ExchangeConfig):
        self.config = config

    def start(self, name: str, values: torch.Tensor, indices: torch.Tensor, numel: int) -> Pending:
        """Launch the allgather of this worker's ``k`` entries of a ``numel``-element unit."""
        config = self.config
        dense_dtype = values.dtype
        if config.prescale() != 1.0:
            values = values * config.prescale()
        wire_values, ctx = config.compression.compress(values)
        index_dtype = sparse.index_dtype_for(numel)
        message = sparse.pack(wire_values, indices, index_dtype)
        handle = hvd.allgather_async(message, name=f"lags.sparse.{name}", process_set=config.process_set)
        k, wire_dtype = values.numel(), wire_values.dtype

        def finish(gathered: torch.Tensor):
            all_values, all_indices = sparse.unpack(gathered, k, wire_dtype, index_dtype)
            all_values = config.compression.decompress(all_values, ctx)
            dense = sparse.merge(all_values, all_indices, numel, dtype=dense_dtype)
            if config.op == Average:
                dense.div_(config.world)
                if config.postscale() != 1.0:
                    dense.mul_(config.postscale())
            # every other entry is zero: checking the P*k touched ones checks them all
            return dense, all_finite(dense[all_indices])

        return Pending(handle, finish)


class DenseAllreduce:
    def __init__(self, config: ExchangeConfig):
        self.config = config

    def start(self, name: str, tensor: torch.Tensor) -> Pending:
        """Launch Horovod's allreduce of ``tensor`` (compressed as configured)."""
        config = self.config
        compressed, ctx = config.compression.compress(tensor)
        handle = hvd.allreduce_async_(compressed, name=f"lags.dense.{name}", op=config.op,
                                      prescale_factor=config.prescale(),
                                      postscale_factor=config.postscale(),
                                      process_set=config.process_set)
        def finish(reduced: torch.Tensor):
            dense = config.compression.decompress(reduced, ctx)
            return dense, all_finite(dense)

        return Pending(handle, finish)
