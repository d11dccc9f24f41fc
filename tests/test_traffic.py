"""The traffic harness's report (``lags_hvd.experiments.traffic.summarise``) on a hand-made run."""

import pytest

from lags_hvd import regions
from lags_hvd.experiments.traffic import CONFIGS, ENTRY_BYTES, summarise


def summarised(config: str) -> bool:
    return config.startswith("reduce_scatter")


def test_the_report_skips_the_first_iteration_and_the_summaries_of_the_worst_bucket():
    """Two ranks, one bucket of k = 10 and one of k = 1 (< P: not a bucket of the worst-bucket
    column), three iterations: the first (equal regions) is left out, the rebalancing
    iteration's summary rows count per worker but not per bucket (regional selection sends
    none)."""
    world, summary_rows = 2, regions.SUMMARY_POINTS + 1
    rebalancing = next(t for t in range(1, 100) if regions.rebalancing(t))
    iterations = rebalancing + 1

    def received(rank: int, t: int, config: str) -> dict:
        big = 10 * (rank + 1 + t) * ENTRY_BYTES  # rank 1 receives more; grows with t
        if summarised(config) and regions.rebalancing(t):
            big += summary_rows * ENTRY_BYTES
        return {
            "big": {"sent": 0, "received": big, "k": 10},
            "small": {"sent": 0, "received": 50 * ENTRY_BYTES, "k": 1},
        }

    run = {
        "workers": world,
        "ranks": [
            {config: [received(rank, t, config) for t in range(iterations)] for config in CONFIGS}
            for rank in range(world)
        ],
    }
    report = summarise(run)
    for config in CONFIGS:
        extra = [summary_rows if summarised(config) and regions.rebalancing(t) else 0 for t in range(iterations)]
        worst = [(2 + t) for t in range(1, iterations)]  # rank 1's big bucket, in k
        per_rank = [
            sum((10 * (r + 1 + t) + extra[t] + 50) / 11 for t in range(1, iterations)) / (iterations - 1)
            for r in range(world)
        ]
        assert report[config]["worst_bucket_per_iteration_k"] == pytest.approx(worst)
        assert report[config]["worst_bucket_max_k"] == pytest.approx(iterations + 1)
        assert report[config]["mean_received_k"] == pytest.approx(sum(per_rank) / world)
        assert report[config]["max_received_k"] == pytest.approx(per_rank[1])
