"""The cluster simulator's cost model on known answers (pure; no benchmark data needed)."""

import pytest

from lags_hvd.experiments import simulate

PROFILE = {
    "forward_s": 0.010,
    "backward_s": 0.030,
    "update_s": 0.002,
    "layers": [
        {"name": "fc.bias", "numel": 10, "ready_s": 0.001, "select_s": 0.0001},
        {"name": "fc.weight", "numel": 20000, "ready_s": 0.002, "select_s": 0.0002},
        {"name": "conv.bias", "numel": 5, "ready_s": 0.020, "select_s": 0.0001},
        {"name": "conv.weight", "numel": 30000, "ready_s": 0.030, "select_s": 0.0003},
    ],
}
COSTS = {"topk_select_s": 0.001, "topk_merge_s": 0.0005, "lags_merge_s": 0.0007}


def test_pipeline_serialises_exchanges_on_one_link():
    assert simulate.pipeline([(0.0, 1.0), (0.5, 1.0)]) == 2.0
    assert simulate.pipeline([(3.0, 1.0), (0.0, 1.0)]) == 4.0


def test_messages_ready_while_the_link_is_busy_leave_together():
    cost = lambda nbytes: 1.0 + nbytes  # noqa: E731 (one fixed cost per message)
    # the first leaves alone at 0; the two ready while it is on the link go as one at 3
    assert simulate.batched_pipeline([(0.0, 2.0), (1.0, 1.0), (2.0, 1.0)], cost) == 3.0 + 1.0 + 2.0
    # a message ready after the link freed starts when it is ready
    assert simulate.batched_pipeline([(0.0, 0.0), (5.0, 0.0)], cost) == 6.0
    assert simulate.batched_pipeline([], cost) == 0.0


def test_ring_costs():
    link = simulate.Switched(4, bandwidth=1e9, alpha=1e-5)
    assert link.allreduce(1e9) == pytest.approx(6e-5 + 1.5)
    assert link.allgather(1e6) == pytest.approx(2e-5 + 3e-3)  # log2(4) steps
    shared = simulate.SharedLink(
        {"world_size": 4, "allreduce": {"alpha": 0.0}, "allgather": {"alpha": 0.0}}, rate_bits=8e9
    )
    assert shared.allreduce(1e9) == pytest.approx(6.0) and shared.allgather(1e6) == pytest.approx(0.012)


def test_merged_units_follow_integer_buckets():
    """The optimizer's rule: small layers merge; a large one stays alone and closes the run."""
    layers = [
        {"name": str(i), "numel": n, "ready_s": 0.001 * i, "select_s": 0.0001}
        for i, n in enumerate([10, 20000, 5, 5, 30000, 9000, 9000, 7])
    ]
    units = simulate.merged_units(layers, 16384)
    assert [u["numel"] for u in units] == [10, 20000, 10, 30000, 18000, 7]
    assert [u["ready_s"] for u in units] == [0.0, 0.001, 0.003, 0.004, 0.006, 0.007]  # last member
    assert units[2]["select_s"] == pytest.approx(0.0002)


def test_free_network_leaves_compute_and_overheads():
    free = simulate.Switched(8, bandwidth=float("inf"), alpha=0.0)
    t = simulate.predict(PROFILE, COSTS, free, density=0.01)
    assert t["single"] == t["dense"] == pytest.approx(0.042)
    assert t["topk"] == pytest.approx(0.042 + 0.001 + 0.0005)
    assert t["lags"] == pytest.approx(0.042 + 0.0007 + 0.0007)  # hook work inside backprop + merge


def test_slow_network_lags_hides_early_layers_behind_backprop():
    slow = simulate.Switched(2, bandwidth=1e5, alpha=0.0)  # 100 KB/s
    t = simulate.predict(PROFILE, COSTS, slow, density=0.01)
    assert t["dense"] > t["topk"] > t["lags"]
    assert t["lags"] < t["topk"] - 0.002  # fc's exchange overlapped the rest of backprop


def test_auto_buckets_are_never_slower_than_per_layer_or_one_bucket_in_the_model():
    """lags-auto's buckets are chosen for each network: with a large start-up cost they merge
    (beating per-layer), on a fast link they stay per-layer (pipelining)."""
    expensive = simulate.Switched(16, bandwidth=1e9, alpha=5e-3)
    t = simulate.predict(PROFILE, COSTS, expensive, density=0.01)
    assert t["lags-auto"] < t["lags"]
    units = simulate.auto_units(PROFILE["layers"], expensive, 0.01, 1.0, 0.0)
    assert len(units) < len(PROFILE["layers"]) and sum(u["numel"] for u in units) == 50015
    slow = simulate.Switched(2, bandwidth=1e5, alpha=0.0)
    t = simulate.predict(PROFILE, COSTS, slow, density=0.01)
    assert t["lags-auto"] <= t["lags"] + 1e-12


@pytest.mark.parametrize("alpha", [0.0, 1e-4, 5e-3])
@pytest.mark.parametrize("bandwidth", [1e5, 1e7, 1e9, float("inf")])
def test_no_bucketing_beats_the_bound(alpha, bandwidth):
    """lags_bound_time is below every bucketing the simulator knows, per-layer, merged,
    auto and each contiguous cut of the four layers, and is reached where it should be:
    on a free network it is the compute, the one hook and the merge."""
    from itertools import combinations

    net = simulate.Switched(8, bandwidth=bandwidth, alpha=alpha)
    t = simulate.predict(PROFILE, COSTS, net, density=0.01, min_hook=1e-4)
    layers = PROFILE["layers"]
    cuts = [list(c) for r in range(len(layers)) for c in combinations(range(1, len(layers)), r)]
    for cut in cuts:
        edges = [0, *cut, len(layers)]
        units = [
            {
                "numel": sum(layer["numel"] for layer in layers[a:b]),
                "ready_s": layers[b - 1]["ready_s"],
                "select_s": sum(layer["select_s"] for layer in layers[a:b]),
            }
            for a, b in zip(edges, edges[1:])
        ]
        time = simulate.lags_time(0.010, 0.030, 0.002, COSTS["lags_merge_s"], units, net, 0.01, 1.0, 1e-4)
        assert t["lags-bound"] <= time + 1e-15
    assert t["lags-bound"] <= min(t["lags"], t["lags-merged"], t["lags-auto"]) + 1e-15
    if bandwidth == float("inf") and alpha == 0.0:
        assert t["lags-bound"] == pytest.approx(0.042 + 1e-4 + 0.0007)


def test_alltoall_costs():
    link = simulate.Switched(4, bandwidth=1e9, alpha=1e-5)
    assert link.alltoall(1e9) == pytest.approx(3e-5 + 0.75)  # pairwise: large messages
    assert link.alltoall(8.0) == pytest.approx(2 * (1e-5 + 4e-9))  # Bruck: small ones
    shared = simulate.SharedLink(
        {"world_size": 4, "allreduce": {"alpha": 0.0}, "allgather": {"alpha": 1e-3}}, rate_bits=8e9
    )
    assert shared.alltoall(1e6) == pytest.approx(1e-3 + 3e-3)


def test_reduce_scatter_traffic_does_not_grow_with_p():
    """Bandwidth-bound, a sparse allgather's time grows as P - 1; the split and the gather of
    reduce_scatter stay about 2k rows, so at large P it wins, and not at P = 2."""

    def lags_times(workers):
        link = simulate.Switched(workers, bandwidth=1e6, alpha=0.0)
        return simulate.predict(PROFILE, COSTS, link, density=0.5)

    small, large = lags_times(2), lags_times(64)
    assert large["lags-merged"] > 20 * small["lags-merged"]
    assert large["lags-rs"] < 3 * small["lags-rs"] and large["lags-rs"] < large["lags-merged"] / 10
    units = simulate.merged_units(PROFILE["layers"], simulate.MERGE_NUMEL)
    k = [simulate.k_for_density(0.5, u["numel"]) for u in units]
    link = simulate.Switched(2, bandwidth=1e6, alpha=0.0)
    summaries = len(units) * (simulate.SUMMARY_POINTS + 1) / simulate.REBALANCE_EVERY
    expected_gather = link.allgather((sum(k) / 2 + summaries) * simulate.ROW_BYTES)
    split_end = simulate.pipeline(
        [
            (u["ready_s"] + sum(x["select_s"] for x in units[: i + 1]), link.alltoall(n * simulate.ROW_BYTES))
            for i, (u, n) in enumerate(zip(units, k))
        ]
    )
    assert small["lags-rs"] == pytest.approx(0.010 + max(0.030 + 0.0007, split_end) + expected_gather + 0.0007 + 0.002)
    # owners keeping 2k: the split is the same, the gather carries twice the kept rows
    keep2 = simulate.lags_rs_time(0.010, 0.030, 0.002, 0.0007, units, link, 0.5, 1.0, 0.0, owner_keep=2.0)
    kept2 = sum(min(u["numel"], 2 * n) for u, n in zip(units, k))
    assert keep2 == pytest.approx(
        0.010
        + max(0.030 + 0.0007, split_end)
        + 0.0007
        + 0.002
        + link.allgather((kept2 / 2 + summaries) * simulate.ROW_BYTES)
    )


def test_crossover_is_the_first_p_from_which_reduce_scatter_always_wins():
    rows = [
        {"model": "m", "rate_gbit": rate, "workers": p, "auto_rs_vs_auto": ratio}
        for rate in simulate.RATES_GBIT
        for p, ratio in ((2, 0.9), (4, 1.1), (8, 0.99), (16, 1.2), (32, 1.5))
    ]
    assert simulate.crossovers(rows) == {"m": {str(rate): 16 for rate in simulate.RATES_GBIT}}
    ties = [
        {"model": "m", "rate_gbit": rate, "workers": p, "auto_rs_vs_auto": ratio}
        for rate in simulate.RATES_GBIT
        for p, ratio in ((2, 0.999), (4, 1.002), (8, 1.001))
    ]
    assert simulate.crossovers(ties) == {"m": {str(rate): None for rate in simulate.RATES_GBIT}}


def test_host_work_per_bucket_is_the_engines_hook_time_per_bucket():
    assert simulate.host_seconds_per_bucket(
        {"fixed_cost_per_bucket_us": 159.0, "hook_per_bucket_us": 80.0}
    ) == pytest.approx(80e-6)
    with pytest.raises(ValueError, match="hook_per_bucket_us"):
        simulate.host_seconds_per_bucket({"fixed_cost_per_bucket_us": 159.0})  # a record from before the field
    with pytest.raises(ValueError, match="finite"):
        simulate.host_seconds_per_bucket({"hook_per_bucket_us": float("nan")})


def test_a_dearer_bucket_slows_per_layer_lags_and_auto_merges_more():
    """The host cost per bucket is charged to every bucket's hook, inside backprop: on a free
    link per-layer LAGS pays it once per layer, and auto buckets merge everything to pay it once."""
    free = simulate.Switched(16, bandwidth=float("inf"), alpha=0.0)
    cheap = simulate.predict(PROFILE, COSTS, free, density=0.01, scale=0.01, min_hook=10e-6)
    dear = simulate.predict(PROFILE, COSTS, free, density=0.01, scale=0.01, min_hook=2e-3)
    assert dear["lags"] - cheap["lags"] == pytest.approx(4 * (2e-3 - 10e-6))
    assert dear["lags-auto"] - cheap["lags-auto"] == pytest.approx(2e-3 - 10e-6)
    assert len(simulate.auto_units(PROFILE["layers"], free, 0.01, 0.01, 2e-3)) == 1


def test_host_growth_is_the_measured_cost_beyond_p_8_interpolated_in_log_p():
    record = {
        "worlds": {str(p): {"reduce_scatter": {"mean_us": us}} for p, us in [(2, 900), (8, 100), (32, 140), (128, 100)]}
    }
    growth = lambda p: simulate.host_growth(record, "reduce_scatter", p)  # noqa: E731
    assert growth(2) == growth(8) == 0.0 and simulate.host_growth(None, "reduce_scatter", 256) == 0.0
    assert growth(32) == pytest.approx(40e-6)
    assert growth(16) == pytest.approx(20e-6)  # halfway in log P
    assert growth(128) == 0.0 and growth(256) == 0.0  # never below 0; flat beyond the last measured
    with pytest.raises(ValueError, match="P = 8"):
        simulate.host_growth({"worlds": {"2": {"reduce_scatter": {"mean_us": 1.0}}}}, "reduce_scatter", 64)


def test_the_host_work_measurement_times_every_path_at_every_world():
    from lags_hvd.experiments import host_work

    result = host_work.measure([2, 8], rounds=1, model="resnet20")
    assert result["buckets"] > 10 and set(result["worlds"]) == {"2", "8"}
    for per_path in result["worlds"].values():
        assert set(per_path) == set(host_work.PATHS)
        assert all(v["mean_us"] > 0 and v["largest_us"] > 0 for v in per_path.values())
