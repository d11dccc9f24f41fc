"""``Dense``: a bucket sent whole (k = numel) with the in-place allreduce, as Horovod's
optimizer does; what arrives is the merged gradient itself, copied into the bucket's
range only where the wire changed its dtype (``exchange.DenseAllreduce``)."""

from __future__ import annotations

import torch

from ..exchange import DenseAllreduce
from .base import Aggregation

__all__ = ["Dense"]


class Dense(Aggregation):
    def __init__(self, config, state, select, options):
        super().__init__(config, state, select, options)
        self._wire = DenseAllreduce(config)

    def nothing(self, unit, k):
        return torch.zeros(unit.numel, dtype=unit.dtype, device=unit.device), None

    def start(self, unit, values, indices):
        return self._wire.start(unit.name, values)

    def allreduce(self, name: str, tensor: torch.Tensor):
        """The average of ``tensor`` over the ranks, as a dense bucket's (the delta's monitor)."""
        return self._wire.start(name, tensor)

    def merge(self, key, dense, parts):
        merged = []
        for offset, reduced, contribution in parts:
            target = dense[offset : offset + contribution.unit.numel]
            if reduced.data_ptr() != target.data_ptr():
                target.copy_(reduced)
            merged.append(target)
        return merged, []
