"""Reduce-scatter aggregation's pure pieces (lags_hvd.regions), and a round of them against its numpy reference."""

from types import SimpleNamespace

import numpy as np
import oracle
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_residual import memory_for

from lags_hvd import regions, selection
from lags_hvd.aggregation.reduce_scatter import ReduceScatter
from lags_hvd.exchange import ExchangeConfig


def test_equal_boundaries_give_min_p_k_owners_equal_regions():
    """R = min(P, K) owners, K the entries kept in all."""
    assert regions.equal_boundaries(10, 4, kept=4) == [0, 2, 5, 7, 10]
    assert regions.equal_boundaries(10, 4, kept=2) == [0, 5, 10, 10, 10]  # k < P: two owners, two empty regions
    assert regions.equal_boundaries(3, 4, kept=3) == [0, 1, 2, 3, 3]
    assert regions.equal_boundaries(5, 1, kept=2) == [0, 5]


def test_summaries_describe_what_arrived_and_balance_the_next_regions():
    """Two owners: 0..49 received 3, 4, 5, 6 and 50..99 received 90..93. Balanced for two
    owners, the boundary is where half of the 8 entries lie before it: 90."""
    low = regions.summary(torch.tensor([6, 3, 5, 4]), 0).tolist()
    high = regions.summary(torch.tensor([93, 91, 90, 92]), 50).tolist()
    assert low == [3, 3, 4, 4, 5, 5, 6, 6, 4] and high == [90, 90, 91, 91, 92, 92, 93, 93, 4]
    assert regions.summary(torch.tensor([], dtype=torch.int64), 50).tolist() == [50] * 8 + [0]
    assert regions.balanced_boundaries([low, high], 100, 2, kept=8) == [0, 90, 100]
    assert regions.balanced_boundaries([low, high], 100, 4, kept=8) == [0, 5, 90, 92, 100]
    assert regions.balanced_boundaries([low, high], 100, 4, kept=2) == [0, 90, 100, 100, 100]  # two owners
    nothing = regions.summary(torch.tensor([], dtype=torch.int64), 0).tolist()
    assert regions.balanced_boundaries([nothing, nothing], 10, 2, kept=2) == [0, 5, 10]


def test_boundaries_fit_only_the_number_of_owners_they_were_made_for():
    assert regions.fits([0, 5, 10], 10, 2, kept=2) and regions.fits([0, 10, 10], 10, 2, kept=1)
    assert not regions.fits([0, 5, 10], 10, 2, kept=1)  # K fell below P: region 1 would have no owner
    assert not regions.fits([0, 10, 10], 10, 2, kept=2)  # K rose: owner 1 would have an empty region
    assert not regions.fits([0, 5, 9], 10, 2, kept=2) and not regions.fits([0, 5, 10], 10, 3, kept=3)


def test_owners_keep_exactly_k_between_them():
    assert regions.region_k([0, 25, 50, 75, 100], 10) == [3, 3, 2, 2]
    assert regions.region_k([0, 100, 100, 100, 100], 1) == [1, 0, 0, 0]
    assert regions.region_k([0, 1, 2, 3, 3], 3) == [1, 1, 1, 0]
    assert regions.region_k([0, 1, 50, 100, 100], 9) == [1, 2, 2, 0]  # capped by a region's size


def test_owner_keep_scales_what_the_owners_keep_up_to_the_unit():
    assert [regions.global_k(10, 1000, c) for c in (1, 1.05, 2, 2.5)] == [10, 11, 20, 25]
    assert regions.global_k(10, 12, 4) == 12 and regions.global_k(1, 5, 3) == 3
    assert regions.owners(4, regions.global_k(1, 100, 3)) == 3  # k = 1, c = 3: three owners, not one
    assert regions.global_k(50, 10**6, 1.1) == 55 and regions.global_k(100, 10**6, 1.1) == 110  # not 56, 111
    assert regions.global_k(2, 100, 1e308) == 100  # no overflow: the whole unit


def test_regional_shares_apportion_k_by_region_size_and_reach_every_region():
    assert regions.regional_k([0, 25, 50, 75, 100], 10) == [3, 2, 3, 2]  # 10 b / 100 rounded: 0, 3, 5, 8, 10
    assert sum(regions.regional_k([0, 2, 5, 7, 10], 10)) == 10  # density 1: every entry
    assert regions.regional_k([0, 2, 5, 7, 10], 10) == [2, 3, 2, 3]
    assert regions.regional_k([0, 100, 100, 100, 100], 1) == [1, 0, 0, 0]  # empty regions send nothing
    assert regions.regional_k([0, 50, 100], 1) == [1, 1]  # raised to 1: a NaN anywhere is sent
    assert regions.regional_k([0, 1, 99, 100], 3) == [1, 3, 1]


def test_regional_owner_shares_follow_the_workers_shares():
    """k'_r = c k_r for a whole c, so the owner that receives one row more in the split keeps
    c more and receives c fewer in the gather: (P-1) k_r + K - k'_r = (P-1-c) k_r + c k."""
    eight = regions.equal_boundaries(80_000, 8, 20)
    assert regions.regional_k(eight, 10) == [1, 2, 1, 1, 1, 2, 1, 1]
    assert regions.regional_keep(eight, 10, 20) == [2, 4, 2, 2, 2, 4, 2, 2]  # not K/R's 3,3,3,3,2,2,2,2
    assert regions.regional_keep(eight, 10, 15) == [2, 3, 1, 2, 1, 3, 2, 1]  # c = 1.5: [15 M_r / 10] differenced
    assert regions.regional_keep([0, 1, 2, 3, 3], 3, 6) == [1, 1, 1, 0]  # capped by the region's size
    for world in range(2, 9):
        for k in range(world, 120):
            for c in (1, 2, 3):
                boundaries = regions.equal_boundaries(10_000, world, c * k)
                shares, keep = regions.regional_k(boundaries, k), regions.regional_keep(boundaries, k, c * k)
                assert keep == [c * n for n in shares] and sum(keep) == c * k
                received = [(world - 1) * n + c * k - kept for n, kept in zip(shares, keep)]
                assert max(received) <= (world - 1 - c) * -(-k // world) + c * k or c > world - 1


def test_regional_selection_is_each_regions_exact_top_k():
    """Against the numpy oracle: TopK of every region at its share, indices ascending; a NaN
    in a region whose entries are otherwise the smallest is still sent."""
    from lags_hvd import selection

    x = torch.tensor([5.0, -4.0, 0.1, 0.2, 0.3, -0.4, 9.0, 8.0, 0.0, 7.0])
    boundaries = [0, 3, 6, 10]
    values, indices = regions.select_regional(x, 3, boundaries, selection.select_torch)
    assert indices.tolist() == [0, 5, 6] and torch.equal(values, x[[0, 5, 6]])
    x[3] = float("nan")
    _, indices = regions.select_regional(x, 3, boundaries, selection.select_torch)
    assert indices.tolist() == [0, 3, 6]
    rng = np.random.default_rng(3)
    for _ in range(20):
        d, world = int(rng.integers(5, 60)), int(rng.integers(1, 6))
        k = int(rng.integers(1, d + 1))
        b = regions.equal_boundaries(d, world, k)
        x = torch.from_numpy(rng.standard_normal(d).astype(np.float32))
        _, got = regions.select_regional(x, k, b, selection.select_sampled)
        want = np.concatenate(
            [
                lo + oracle.topk_indices(x.numpy()[lo:hi], n)
                for lo, hi, n in zip(b, b[1:], regions.regional_k(b, k))
                if n
            ]
        )
        assert got.tolist() == sorted(want.tolist())


def test_splits_count_the_entries_of_every_region():
    counts = regions.splits(torch.tensor([0, 1, 5, 6, 9]), [0, 2, 5, 7, 10])
    assert counts.dtype == torch.int32 and counts.device.type == "cpu"
    assert counts.tolist() == [2, 0, 2, 1]


@pytest.mark.parametrize("rows", [0, 1, 2])
@pytest.mark.parametrize(
    "value_dtype,index_dtype",
    [
        (torch.float32, torch.int32),
        (torch.float64, torch.int32),
        (torch.float16, torch.int32),
        (torch.bfloat16, torch.int32),
        (torch.float64, torch.int64),
    ],
)
def test_rows_of_any_dtype_and_count_round_trip(value_dtype, index_dtype, rows):
    """A rank may receive no row or one: the unpacked columns are aligned for any dtype."""
    values, indices = torch.randn(rows).to(value_dtype), torch.arange(rows) * 7 + 3
    packed = regions.pack_rows(values, indices, index_dtype)
    got_values, got_indices = regions.unpack_rows(packed[:rows], value_dtype, index_dtype)
    assert torch.equal(got_values, values) and torch.equal(got_indices, indices)


@pytest.mark.parametrize(
    "value_dtype,index_dtype",
    [(torch.float32, torch.int32), (torch.float64, torch.int64), (torch.float16, torch.int32)],
)
def test_rows_round_trip(value_dtype, index_dtype):
    values = torch.randn(7).to(value_dtype)
    indices = torch.tensor([0, 3, 4, 8, 100, 2**20, 5])
    rows = regions.pack_rows(values, indices, index_dtype)
    assert rows.shape == (7, index_dtype.itemsize + value_dtype.itemsize) and rows.dtype == torch.uint8
    got_values, got_indices = regions.unpack_rows(rows, value_dtype, index_dtype)
    assert torch.equal(got_values, values) and torch.equal(got_indices, indices)
    assert regions.pack_rows(values, indices, index_dtype, out=rows) is rows  # the buffer is reused
    with pytest.raises(ValueError, match="disagree on the value dtype"):
        regions.unpack_rows(rows, torch.float32 if value_dtype != torch.float32 else torch.float64, index_dtype)


def test_reduce_region_sums_rank_by_rank_and_refuses_foreign_entries():
    values = torch.tensor([1.0, 2.0, 10.0, 20.0, 100.0])
    indices = torch.tensor([5, 7, 5, 6, 7])
    region = regions.reduce_region(values, indices, [2, 2, 1], 5, 3, torch.float32)
    assert region.tolist() == [11.0, 20.0, 102.0]
    with pytest.raises(ValueError, match="outside this rank's region"):
        regions.reduce_region(values, indices, [2, 2, 1], 6, 3, torch.float32)


def test_traffic_counts_only_other_ranks():
    # rank 1 of 3: sends 2 + 4 alltoall entries to others, its 3 kept entries and 9 summary rows
    # to 2 others; receives 5 + 1 from others and their 2 + 3 kept entries and summaries
    q = regions.SUMMARY_POINTS + 1
    assert regions.traffic([2, 9, 4], [5, 7, 1], [2, 3, 3], 1, 8, q) == ((6 + 2 * (3 + q)) * 8, (6 + 2 + 3 + 2 * q) * 8)
    assert regions.traffic([2, 9, 4], [5, 7, 1], [2, 3, 3], 1, 8, 0) == ((6 + 2 * 3) * 8, (6 + 2 + 3) * 8)
    assert regions.rebalancing(0) and regions.rebalancing(regions.REBALANCE_EVERY) and not regions.rebalancing(1)


def library_round(
    accs: list[torch.Tensor], k: int, boundaries: list[int], kept: int, regional: bool, clip: float | None
):
    """One reduce-scatter round over P = len(accs) workers in one process, of the pieces the
    engine composes: each worker's selection and split counts, each owner's reduction and
    kept share, the merge of the global selection G (the exchange's, for P workers), each
    worker's residual keeping what G dropped and, with a clip factor c of the merged
    gradient, given back (1 - c) of what G applied; the rows each worker sent and received,
    and the next boundaries from the owners' summaries. Returns (merged, residuals,
    [(rows sent, rows received)] per worker, the next boundaries)."""
    world, d, select = len(accs), accs[0].numel(), selection.select_torch
    picks = [regions.select_regional(acc, k, boundaries, select) if regional else select(acc, k) for acc in accs]
    counts = [regions.splits(indices, boundaries).tolist() for _, indices in picks]  # [worker][region]
    shares = regions.regional_keep(boundaries, k, kept) if regional else regions.region_k(boundaries, kept)
    kept_values, kept_indices, summaries = [], [], []
    for r, (lo, hi) in enumerate(zip(boundaries, boundaries[1:])):
        inside = [(indices >= lo) & (indices < hi) for _, indices in picks]
        values = torch.cat([v[mask] for (v, _), mask in zip(picks, inside)])
        indices = torch.cat([i[mask] for (_, i), mask in zip(picks, inside)])
        region = regions.reduce_region(values, indices, [c[r] for c in counts], lo, hi - lo, torch.float32)
        if shares[r]:
            chosen, where = select(region, shares[r])
            kept_values.append(chosen)
            kept_indices.append(where + lo)
        summaries.append(regions.summary(indices, lo).tolist())
    applied_values, applied_indices = torch.cat(kept_values), torch.cat(kept_indices)
    config = ExchangeConfig(SimpleNamespace(size=world, rank=0))
    merged = torch.zeros(d)
    ReduceScatter(config, None, select, SimpleNamespace(regional_selection=False)).merge_into(
        merged, [(0, (applied_values.view(1, -1), applied_indices.view(1, -1)), d)]
    )
    residuals = []
    for acc, (values, indices) in zip(accs, picks):
        memory, _ = memory_for(d)
        memory.accumulate("p0", [acc])
        applied = torch.isin(indices, applied_indices)
        memory.retain("p0", indices, where=applied)
        if clip is not None:
            memory.give_back("p0", indices, values, torch.tensor(clip), where=applied)
        memory.commit()
        residuals.append(memory.residual("p0"))
    rows = 0 if regional else regions.SUMMARY_POINTS + 1
    traffic = [regions.traffic(counts[p], [c[p] for c in counts], shares, p, 1, rows) for p in range(world)]
    following = boundaries if regional else regions.balanced_boundaries(summaries, d, world, kept)
    return merged, residuals, traffic, following


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(1, 5),
    d=st.integers(1, 40),
    density=st.floats(0.01, 1.0),
    seed=st.integers(0, 10**6),
    clustered=st.booleans(),
    keep=st.sampled_from([1, 1.5, 4]),
    regional=st.booleans(),
    clip=st.sampled_from([None, 0.25]),
)
def test_the_librarys_round_equals_the_reference_and_conserves_every_workers_mass(
    world, d, density, seed, clustered, keep, regional, clip
):
    """``library_round`` against oracle.reduce_scatter_round: the merged gradient (divided by
    P), every worker's residual (what G dropped kept, and with a clip c, eps + (1 - c)
    (acc - eps) as reference_run gives back), the rows sent and received and the next
    boundaries. And what they mean: acc_p = eps_p + (p's contributions that G applied),
    the merged gradient their average, at most K entries, the owners' loads bounded."""
    rng = np.random.default_rng(seed)
    accs = [rng.standard_normal(d).astype(np.float32) for _ in range(world)]
    if clustered:  # the large entries of every worker in one corner: one region gets them all
        for acc in accs:
            acc[: max(1, d // 5)] *= 100
    k = oracle.k_for(density, d)
    kept = regions.global_k(k, d, keep)
    boundaries = regions.equal_boundaries(d, world, kept)
    merged, residuals, following, traffic, _ = oracle.reduce_scatter_round(
        accs, k, boundaries, kept=kept, regional=regional
    )
    got_merged, got_residuals, got_traffic, got_following = library_round(
        [torch.from_numpy(acc) for acc in accs], k, boundaries, kept, regional, clip
    )
    np.testing.assert_array_equal(got_merged.numpy(), merged)
    for p, (acc, eps, got) in enumerate(zip(accs, residuals, got_residuals)):
        given_back = eps if clip is None else eps + (np.float32(1) - np.float32(clip)) * (acc - eps)
        np.testing.assert_allclose(got.numpy(), given_back, rtol=1e-6, atol=0, err_msg=f"worker {p}")
    assert got_traffic == traffic
    assert got_following == following
    sent = [
        np.concatenate(
            [
                lo + oracle.topk_indices(acc[lo:hi], n)
                for lo, hi, n in zip(boundaries, boundaries[1:], regions.regional_k(boundaries, k))
                if n
            ]
        )
        if regional
        else oracle.topk_indices(acc, k)
        for acc in accs
    ]
    total_applied = np.zeros(d, np.float64)
    for acc, eps, chosen in zip(accs, residuals, sent):
        applied = acc - eps
        assert set(np.flatnonzero(eps != acc)) <= set(chosen.tolist())  # only sent entries left
        total_applied += applied
    np.testing.assert_allclose(merged * world, total_applied, rtol=1e-5, atol=1e-5)
    assert following[0] == 0 and following[-1] == d and following == sorted(following)
    # the global selection: at most K entries (regional: every region's share raised to at least 1)
    kept_at_most = sum(regions.regional_keep(boundaries, k, kept)) if regional else kept
    assert np.count_nonzero(merged) <= kept_at_most
    # an owner receives at most every other worker's k, plus the others' kept entries (< K) and summaries
    assert all(received <= (world - 1) * (k + oracle.SUMMARY + 1) + kept_at_most for _, received in traffic)
    if regional:  # no summaries, regions unchanged, and exactly (P-1) k_p arrive at owner p
        shares, owned = regions.regional_k(boundaries, k), regions.regional_keep(boundaries, k, kept)
        assert following == boundaries
        assert [received for _, received in traffic] == [
            (world - 1) * shares[p] + sum(owned) - owned[p] for p in range(world)
        ]
