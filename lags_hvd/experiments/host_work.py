"""Host work per bucket as P grows, in one process: no P processes needed.

    python -m lags_hvd.experiments.host_work [--worlds 2,8,32,128,256] [--out FILE]

The pure steps one rank runs for one bucket, timed at the world size given, on ResNet-50's
per-layer buckets at density 0.001 (the paper's exchange), with the other P - 1 ranks'
contributions synthetic (random entries of the right counts), one thread:

* ``allgather``: the top-k of acc, its message packed; then the P messages unpacked and
  merged into the zeroed bucket (what arrives grows with P: that is the allgather's traffic).
* ``reduce_scatter``: the top-k, its split sizes, its rows packed; as an owner, the P
  contributions to its region unpacked, summed, its share selected and packed; then the
  owners' global selection unpacked and merged.
* ``regional``: the same with regional selection (each region's share selected: in one
  compiled pass for small shares, ``regions.select_regional``).
* ``dense``: the bucket's gradient copied into its send buffer (the dense path's host work).

Each is the median over rounds of the steps' time, in microseconds per bucket (the mean
over the model's buckets), and for the largest bucket. ``make simulate`` reads the result
(the host cost per bucket as a function of P).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from lags_hvd import regions, selection, sparse
from lags_hvd.density import k_for_density
from lags_hvd.experiments import models

__all__ = ["measure", "main"]

DENSITY = 0.001
PATHS = ("allgather", "reduce_scatter", "regional", "dense")


def _contributions(numel: int, counts: list[int], start: int, size: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of every rank's entries to a region ``[start, start + size)``: ``counts[r]`` distinct
    positions each, rank by rank."""
    values, indices = [], []
    for count in counts:
        indices.append(start + torch.randperm(size, generator=gen)[:count].sort().values)
        values.append(torch.randn(count, generator=gen))
    return torch.cat(values), torch.cat(indices)


class _Bucket:
    """One bucket's inputs at world P, made once; ``run(path)`` is one rank's host work."""

    def __init__(self, numel: int, world: int, gen):
        self.numel, self.world = numel, world
        self.acc = torch.randn(numel, generator=gen)
        self.grad, self.send = torch.randn(numel, generator=gen), torch.empty(numel)
        self.k = k_for_density(DENSITY, numel)
        self.index_dtype = sparse.index_dtype_for(numel)
        kept = regions.global_k(self.k, numel, 1.0)
        self.boundaries = regions.equal_boundaries(numel, world, kept)
        start, end = self.boundaries[0], self.boundaries[1]
        # the allgather: P messages of k entries
        values, indices = _contributions(numel, [self.k] * world, 0, numel, gen)
        self.messages = torch.cat(
            [sparse.pack(v, i, self.index_dtype) for v, i in zip(values.split(self.k), indices.split(self.k))]
        )
        self.message_columns = sparse.MessageColumns((self.k,), world, torch.float32, self.index_dtype)
        self.merge_columns = sparse.MergeColumns(((0, self.k, numel),), "cpu")
        self.dense = torch.zeros(numel)
        # reduce_scatter: this rank owns region 0; every rank sends it about its share of k
        self.shares = regions.region_k(self.boundaries, kept)
        self.regional_shares = regions.regional_k(self.boundaries, self.k)
        received = [max(1, round(self.k * (end - start) / numel))] * world
        self.received = (
            regions.pack_rows(*_contributions(numel, received, start, end - start, gen), self.index_dtype),
            received,
        )
        owners = _contributions(numel, [s for s in self.shares], 0, numel, gen)
        self.gathered = regions.pack_rows(*owners, self.index_dtype)
        self.gathered_columns = sparse.MergeColumns(((0, self.gathered.shape[0], numel),), "cpu")

    def run(self, path: str) -> None:
        if path == "dense":
            self.send.copy_(self.grad)
            return
        if path == "allgather":
            values, indices = selection.select_sampled(self.acc, self.k)
            sparse.pack(values, indices, self.index_dtype)
            all_values, all_indices = sparse.unpack_many([self.messages], self.message_columns)
            self.dense.zero_()
            sparse.merge_into(self.dense, all_values, all_indices, self.merge_columns, divide_by=self.world)
            return
        if path == "regional":
            values, indices = regions.select_regional(self.acc, self.k, self.boundaries, selection.select_sampled)
        else:
            values, indices = selection.select_sampled(self.acc, self.k)
            regions.splits(indices, self.boundaries).tolist()
        regions.pack_rows(values, indices, self.index_dtype)
        rows, counts = self.received  # as this region's owner
        got_values, got_indices = regions.unpack_rows(rows, torch.float32, self.index_dtype)
        start, end = self.boundaries[0], self.boundaries[1]
        region = regions.reduce_region(got_values, got_indices, counts, start, end - start, torch.float32)
        share = (self.regional_shares if path == "regional" else self.shares)[0]
        chosen, where = selection.select_sampled(region, max(1, min(share, region.numel())))
        regions.pack_rows(chosen, where + start, self.index_dtype)
        all_values, all_indices = regions.unpack_rows(self.gathered, torch.float32, self.index_dtype)
        self.dense.zero_()
        sparse.merge_into(self.dense, all_values.view(1, -1), all_indices.view(1, -1), self.gathered_columns)


def measure(worlds: list[int], rounds: int = 7, model: str = "resnet50") -> dict:
    """Per world size: microseconds per bucket of every path (the mean over the model's
    per-layer buckets, each the median over ``rounds``) and of its largest bucket."""
    torch.set_num_threads(1)
    net, _, _ = models.build(model, 1)
    sizes = [p.numel() for p in net.parameters() if p.numel() > 1]
    gen = torch.Generator().manual_seed(0)
    result = {"model": model, "density": DENSITY, "buckets": len(sizes), "largest": max(sizes), "worlds": {}}
    for world in worlds:
        buckets = [_Bucket(numel, world, gen) for numel in sizes]
        per_path = {}
        for path in PATHS:
            times = []
            for bucket in buckets:
                bucket.run(path)  # warm-up: caches, allocations
                samples = []
                for _ in range(rounds):
                    start = time.perf_counter()
                    bucket.run(path)
                    samples.append(time.perf_counter() - start)
                times.append(statistics.median(samples))
            per_path[path] = {
                "mean_us": 1e6 * statistics.fmean(times),
                "largest_us": 1e6 * times[sizes.index(max(sizes))],
            }
        result["worlds"][str(world)] = per_path
        print(
            f"P={world:4d}  "
            + "  ".join(
                f"{path} {v['mean_us']:8.1f} us ({v['largest_us']:8.1f} largest)" for path, v in per_path.items()
            ),
            flush=True,
        )
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", default="2,8,32,128,256")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    result = measure([int(w) for w in args.worlds.split(",")], args.rounds)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
