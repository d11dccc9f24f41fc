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

from .. import regions, sparse
from ..exchange import Pending
from .base import SparseAggregation

__all__ = ["ReduceScatter"]


class ReduceScatter(SparseAggregation):
    """``start`` (from the hook) sends this worker's entries of region r to rank r with one
    alltoall; ``complete`` (in ``synchronize()``) sums this rank's region of what arrived,
    keeps its top ``k'`` and allgathers them (with its balancing summary on a rebalancing
    iteration): every owner's entries, with distinct indices, which the merge applies like
    one rank's contribution."""

    def __init__(self, config, state, select, options):
        super().__init__(config, state, select, options)
        self.regional = options.regional_selection
        self._rows: dict[str, torch.Tensor] = {}  # send rows per bucket, reused while k stays

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
        """Launch the alltoall; its result is ``(values, indices, sent counts, received
        counts)``: the entries of this rank's region from every rank, in rank order. Under
        regional selection every rank sends owner r its ``regional_k[r]`` entries, so each
        knows what it receives; else the counts are read from ``indices`` (one host read
        on an accelerator)."""
        config, name, numel = self.config, unit.name, unit.numel
        boundaries = self.boundaries(unit)
        dense_dtype, index_dtype = values.dtype, sparse.index_dtype_for(numel)
        if config.prescale() != 1.0:
            values = values * config.prescale()
        wire_values, ctx = config.compression.compress(values)
        rows = self._rows[name] = regions.pack_rows(wire_values, indices, index_dtype, self._rows.get(name))
        if self.regional:
            counts = regions.regional_k(boundaries, self.state.k[name])
            received = [counts[config.rank]] * config.world
            counts = torch.tensor(counts, dtype=torch.int32)
        else:
            counts, received = regions.splits(indices, boundaries), None
        wire_name = f"{config.namespace}.split.{name}"
        handle = config.collectives.alltoall(rows, counts, wire_name, received=received)

        def finish(arrived):
            received, received_counts = arrived
            got_values, got_indices = regions.unpack_rows(received, wire_values.dtype, index_dtype)
            got_values = config.compression.decompress(got_values, ctx)
            return got_values.to(dense_dtype), got_indices, counts.tolist(), received_counts.tolist()

        return Pending(handle, finish, wire_name, config)

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
            contribution.pending = self._reduce_and_gather(
                unit.name, split, boundaries, shares, unit.numel, regions.rebalancing(iteration) and not self.regional
            )

    def merge(self, key, dense, parts):
        commits = []
        for _, (_, kept, summaries), contribution in parts:
            contribution.applied = torch.isin(contribution.indices, kept.view(-1))
            commits.append(self._clear(contribution.unit.name, contribution.indices, contribution.applied))
            if summaries is not None:
                commits.append(self._rebalancing(contribution.unit, summaries))
        merged = self.merge_into(
            dense,
            [(offset, (values, kept), contribution.unit.numel) for offset, (values, kept, _), contribution in parts],
        )
        return [merged], commits

    def merge_into(self, dense: torch.Tensor, parts) -> torch.Tensor:
        """Reduce the global selections of several buckets of one arena into ``dense`` (their
        ranges must be zero) at once: ``parts`` is ``(offset, (values, indices), numel)``
        per bucket, (1, m) each as ``complete``'s gathers gave them. Returns the merged
        values (what this rank sent stays staged until the commit knows G)."""
        placed = tuple((offset, values.shape[1], numel) for offset, (values, _), numel in parts)
        (merge_columns,) = self._cached_columns(
            (dense.data_ptr(),), placed, lambda: (sparse.MergeColumns(placed, dense.device),)
        )
        values = torch.cat([values for _, (values, _), _ in parts], dim=1)
        indices = torch.cat([indices for _, (_, indices), _ in parts], dim=1)
        return self._sum_into(dense, values, indices, merge_columns)[0]

    def _reduce_and_gather(
        self, name: str, split: tuple, boundaries: list[int], shares: list[int], numel: int, summarise: bool
    ) -> Pending:
        """Sum this rank's region of what ``start``'s alltoall brought (``split``), keep
        its top ``k'`` (``shares[rank]``; ``shares``: what every owner keeps) and launch the
        allgather of every owner's kept entries (and, when ``summarise``, of its balancing
        summary; else the summaries come back as None)."""
        config = self.config
        values, indices, sent_counts, received_counts = split
        rank, index_dtype = config.rank, sparse.index_dtype_for(numel)
        start, end = boundaries[rank], boundaries[rank + 1]
        region = regions.reduce_region(values, indices, received_counts, start, end - start, values.dtype)
        if shares[rank]:
            chosen, chosen_indices = self.select(region, shares[rank])
            chosen_indices = chosen_indices + start
        else:
            chosen, chosen_indices = region[:0], torch.zeros(0, dtype=torch.int64, device=region.device)
        summary = regions.summary(indices, start) if summarise else chosen_indices[:0]
        wire_values, ctx = config.compression.compress(torch.cat([chosen, chosen.new_zeros(summary.numel())]))
        rows = regions.pack_rows(wire_values, torch.cat([chosen_indices, summary]), index_dtype)
        self._traffic[name] = regions.traffic(
            sent_counts, received_counts, shares, rank, rows.shape[1], summary.numel()
        )
        wire_name = f"{config.namespace}.gather.{name}"
        handle = config.collectives.allgather(rows, wire_name, sizes=[share + summary.numel() for share in shares])

        def finish(gathered: torch.Tensor):
            all_values, all_indices = regions.unpack_rows(gathered, wire_values.dtype, index_dtype)
            all_values = config.compression.decompress(all_values, ctx).to(values.dtype)
            if not summarise:
                return all_values.view(1, -1), all_indices.view(1, -1), None
            entries, summaries, row, rows = [], [], 0, summary.numel()
            for count in shares:  # each owner: its kept entries, then its summary
                entries.append(torch.arange(row, row + count))
                summaries.append(all_indices[row + count : row + count + rows])
                row += count + rows
            chosen_rows = torch.cat(entries).to(all_indices.device)
            return (
                all_values[chosen_rows].view(1, -1),
                all_indices[chosen_rows].view(1, -1),
                torch.stack(summaries).tolist(),
            )

        return Pending(handle, finish, wire_name, config)

    def _rebalancing(self, unit, summaries):
        """The next regions from every owner's summary (the same on every rank)."""

        def rebalance() -> None:
            self.state.regions[unit.name] = regions.balanced_boundaries(
                summaries, unit.numel, self.config.world, self.global_k(unit)
            )

        return rebalance
