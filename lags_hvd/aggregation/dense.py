"""``Dense``: a bucket sent whole (k = numel) with the in-place allreduce, as Horovod's
optimizer does; what arrives is the merged gradient itself, copied into the bucket's
range only where the wire changed its dtype (bfloat16, which not every backend can
reduce, travels as float32)."""

from __future__ import annotations

import torch

from ..exchange import Pending
from .base import Aggregation

__all__ = ["Dense"]

# Dtypes not every backend can reduce: they go over the wire as float32.
_WIRE_DTYPE = {torch.bfloat16: torch.float32}


class Dense(Aggregation):
    def nothing(self, unit, k):
        return torch.zeros(unit.numel, dtype=unit.dtype, device=unit.device), None

    def start(self, unit, values, indices):
        return self.allreduce(unit.name, values)

    def allreduce(self, name: str, tensor: torch.Tensor) -> Pending:
        """Launch the in-place allreduce of ``tensor`` (compressed as configured). The result
        (``Pending.wait()``) is ``tensor`` itself when no dtype conversion was needed, else a
        new tensor of ``tensor``'s dtype. Also the delta monitor's average."""
        config = self.config
        dtype = tensor.dtype
        compressed, ctx = config.compression.compress(tensor.to(_WIRE_DTYPE.get(dtype, dtype)))
        wire_name = f"{config.namespace}.dense.{name}"
        handle = config.collectives.allreduce(
            compressed, wire_name, "average" if config.average else "sum", config.prescale(), config.postscale()
        )

        def finish(reduced: torch.Tensor):
            return config.compression.decompress(reduced, ctx).to(dtype)

        return Pending(handle, finish, wire_name, config)

    def merge(self, key, dense, parts):
        merged = []
        for offset, reduced, contribution in parts:
            target = dense[offset : offset + contribution.unit.numel]
            if reduced.data_ptr() != target.data_ptr():
                target.copy_(reduced)
            merged.append(target)
        return merged, []
