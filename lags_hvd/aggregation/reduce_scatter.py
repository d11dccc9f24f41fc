"""``ReduceScatter``: Ok-Topk's split and reduce (``regions`` has the math).

The hook sends this worker's entries of region r to rank r (one alltoall);
``complete`` then has every owner sum its region, keep its share of K entries and
allgather them (and, on a rebalancing iteration, its balancing summary); the merge
applies that global selection G, and the commit clears in the residual only what this
worker sent and G kept (what it dropped stays) and moves the regions to the owners'
balanced boundaries. With ``regional_selection`` each worker selects its share of k in
every region, so every owner receives exactly (P-1) k_r entries and nothing is rebalanced.
"""

from __future__ import annotations

import torch

from .. import regions
from ..exchange import SparseReduceScatter
from .base import Aggregation

__all__ = ["ReduceScatter"]


class ReduceScatter(Aggregation):
    def __init__(self, config, state, select, options):
        super().__init__(config, state, select, options)
        self._wire = SparseReduceScatter(config, select)
        self.regional = options.regional_selection

    def global_k(self, unit) -> int:
        """K: what the region owners keep between them, for the unit's k in force."""
        return regions.global_k(self.state.k[unit.name], unit.numel, self.options.owner_keep)

    def boundaries(self, unit) -> list[int]:
        """The unit's regions: balanced ones while they fit the K in force, else equal ones."""
        world, kept = self.config.world, self.global_k(unit)
        boundaries = self.state.regions.get(unit.name)
        if boundaries is None or not regions.fits(boundaries, unit.numel, world, kept):
            boundaries = regions.equal_boundaries(unit.numel, world, kept)
        return boundaries

    def selector(self, unit):
        if not self.regional:
            return self.select
        boundaries = self.boundaries(unit)
        return lambda acc, k: regions.select_regional(acc, k, boundaries, self.select)

    def nothing(self, unit, k):
        if not self.regional:
            return super().nothing(unit, k)
        boundaries = self.boundaries(unit)  # by region, as regional selection sends them
        indices = torch.cat(
            [torch.arange(start, start + n) for start, n in zip(boundaries, regions.regional_k(boundaries, k))]
        ).to(unit.device)
        return torch.zeros(indices.numel(), dtype=unit.dtype, device=unit.device), indices

    def start(self, unit, values, indices):
        boundaries = self.boundaries(unit)
        counts = regions.regional_k(boundaries, self.state.k[unit.name]) if self.regional else None
        return self._wire.start(unit.name, values, indices, unit.numel, boundaries, counts)

    def complete(self, contributions, iteration):
        """Once every split has arrived: reduce each owned region and start the gathers."""
        for contribution in contributions:
            unit = contribution.unit
            split = contribution.pending.wait()
            boundaries, kept = self.boundaries(unit), self.global_k(unit)
            shares = (
                regions.regional_keep(boundaries, self.state.k[unit.name], kept)
                if self.regional
                else regions.region_k(boundaries, kept)
            )
            contribution.pending = self._wire.reduce_and_gather(
                unit.name, split, boundaries, shares, unit.numel, regions.rebalancing(iteration) and not self.regional
            )

    def merge(self, key, dense, parts):
        commits = []
        for _, (_, kept, summaries), contribution in parts:
            contribution.applied = torch.isin(contribution.indices, kept.view(-1))
            commits.append(self._clear(contribution.unit.name, contribution.indices, contribution.applied))
            if summaries is not None:
                commits.append(self._rebalancing(contribution.unit, summaries))
        merged, _ = self._wire.merge_into(
            dense,
            [(offset, (values, kept), contribution.unit.numel) for offset, (values, kept, _), contribution in parts],
        )
        return [merged], commits

    def _rebalancing(self, unit, summaries):
        """The next regions from every owner's summary (the same on every rank)."""

        def rebalance() -> None:
            self.state.regions[unit.name] = regions.balanced_boundaries(
                summaries, unit.numel, self.config.world, self.global_k(unit)
            )

        return rebalance

    @property
    def traffic(self) -> dict[str, tuple[int, int]]:
        return dict(self._wire.traffic)
