"""``HorovodCollectives``: the collectives over a Horovod process set.

Only this module and the Horovod-facing API (``lags_hvd.__init__``, ``optimizer``) import
Horovod. Horovod matches collectives by name, so every name is the caller's own (the
optimizer's ``wire_namespace``); bfloat16, which Horovod cannot reduce on every backend, is
reduced as float32 (``aggregation.Dense`` converts).
"""

from __future__ import annotations

import functools

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError
from horovod.torch import mpi_ops

from .base import Collectives

__all__ = ["HorovodCollectives"]

_OPS = {"sum": hvd.Sum, "average": hvd.Average, "max": hvd.Max}


class HorovodCollectives(Collectives):
    """The collectives over ``process_set`` (Horovod's global one by default)."""

    lost = (HorovodInternalError,)
    stall_hint = (
        "; Horovod's stall inspector names the missing ranks on rank 0's output (HOROVOD_STALL_CHECK_TIME_SECONDS)"
    )

    def __init__(self, process_set=None):
        self.process_set = hvd.global_process_set if process_set is None else process_set

    @functools.cached_property
    def size(self) -> int:  # asked of Horovod once: it costs microseconds
        return self.process_set.size()

    @functools.cached_property
    def rank(self) -> int:
        return self.process_set.rank()

    @property
    def global_ranks(self) -> list[int]:
        ranks = self.process_set.ranks  # None for the global process set
        return list(ranks) if ranks is not None else list(range(self.size))

    def global_rank(self) -> int | str:
        try:
            return hvd.rank()
        except ValueError:  # Horovod has shut down (as after a peer's loss)
            return "?"

    def _allgather(self, tensor: torch.Tensor, name: str, sizes: list[int] | None, out: torch.Tensor | None):
        """Any sizes: Horovod's own. ``out``: Horovod's ``allgather_async`` less its allocation
        of the output (``_allgather_async``, 0.28.1's, which resizes ``out`` to what arrived:
        a no-op when the ranks sent what the caller expected)."""
        if out is None:
            return hvd.allgather_async(tensor, name=name, process_set=self.process_set)
        return mpi_ops._allgather_async(tensor, out, name, self.process_set)

    def _alltoall(self, tensor: torch.Tensor, splits: torch.Tensor, name: str, received: list[int] | None):
        return hvd.alltoall_async(tensor, splits=splits, name=name, process_set=self.process_set)

    def _allreduce(self, tensor: torch.Tensor, name: str, op: str, prescale: float, postscale: float):
        return hvd.allreduce_async_(
            tensor,
            name=name,
            op=_OPS[op],
            prescale_factor=prescale,
            postscale_factor=postscale,
            process_set=self.process_set,
        )

    def _broadcast(self, tensor: torch.Tensor, root: int, name: str):
        return hvd.broadcast_async(tensor, root, name=name, process_set=self.process_set)

    def _barrier(self) -> None:
        hvd.barrier(process_set=self.process_set)

    def done(self, handle) -> bool:
        return hvd.poll(handle)

    def _result(self, handle):
        return hvd.synchronize(handle)
