"""``Allgather``: every worker's k selected entries to every worker (the paper's aggregation).

Each worker sends its k entries once and receives the other P-1 workers' ((P-1) k
entries); the merge sums them, ``(1/P) sum_p s_p`` under Average, and reads back from
this rank's own message where its entries went, so the residuals clear them by position
(``exchange.SparseAllgather`` has the message format).
"""

from __future__ import annotations

from ..exchange import SparseAllgather
from .base import Aggregation

__all__ = ["Allgather"]


class Allgather(Aggregation):
    def __init__(self, config, state, select, options):
        super().__init__(config, state, select, options)
        self._wire = SparseAllgather(config)

    def start(self, unit, values, indices):
        return self._wire.start(unit.name, values, indices, unit.numel)

    def merge(self, key, dense, parts):
        merged, positions = self._wire.merge_into(
            dense, [(offset, arrival, part.unit.numel) for offset, arrival, part in parts]
        )

        def clear() -> None:  # eps = acc - s for every bucket of the arena at once
            for memory in self.state.masked_memories():
                memory.retain_positions(key, positions)

        return [merged], [clear]

    @property
    def traffic(self) -> dict[str, tuple[int, int]]:
        return dict(self._wire.traffic)
