"""Selection against the numpy oracle: exact index sets, deterministic ties."""

import functools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import topk_indices

from lags_hvd import _kernels, selection

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def check_exact(select, x: torch.Tensor, k: int):
    values, indices = select(x, k)
    expected = topk_indices(x.float().numpy(), k)
    assert indices.dtype == torch.int64
    np.testing.assert_array_equal(indices.numpy(), expected)
    assert torch.equal(values, x[indices])


def select_torch_by_prefix_count(x: torch.Tensor, k: int):
    """``select_torch`` on its path for tensors above ``COMPOSITE_MAX`` entries, at any size."""
    saved, selection.COMPOSITE_MAX = selection.COMPOSITE_MAX, 0
    try:
        return selection.select_torch(x, k)
    finally:
        selection.COMPOSITE_MAX = saved


SELECTORS = dict(
    selection.SELECTORS,
    sampled_torch_backend=functools.partial(selection.select_sampled, backend="torch"),
    torch_prefix_count=select_torch_by_prefix_count,
)


@pytest.mark.parametrize("name", sorted(SELECTORS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(1, 1), (7, 1), (7, 7), (100, 3), (1000, 10), (4096, 4095), (50_000, 50)])
def test_matches_oracle_on_random_tensors(name, dtype, n, k):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n * 31 + k)).to(dtype)
    check_exact(SELECTORS[name], x, k)


@pytest.mark.parametrize("name", sorted(SELECTORS))
@pytest.mark.parametrize(
    "x,k",
    [
        (torch.zeros(10), 3),  # all zero
        (torch.ones(10), 4),  # all equal
        (torch.tensor([1.0, -1.0, 1.0, -1.0, 0.5]), 3),  # signed ties
        (torch.tensor([0.0, float("inf"), 1.0, float("-inf")]), 2),  # +/- inf
        (torch.tensor([2.0, 0.0, 0.0, 2.0, 1.0, 2.0]), 2),  # ties at the k-th value
    ],
)
def test_ties_and_special_values(name, x, k):
    check_exact(SELECTORS[name], x, k)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-3, 3), min_size=1, max_size=300), st.data())
def test_property_heavy_ties(ints, data):
    x = torch.tensor(ints, dtype=torch.float32)
    k = data.draw(st.integers(1, len(ints)))
    for select in SELECTORS.values():
        check_exact(select, x, k)


def test_bad_arguments():
    with pytest.raises(ValueError, match="1-D"):
        selection.select_sampled(torch.zeros(2, 2), 1)
    with pytest.raises(ValueError, match="k must be"):
        selection.select_torch(torch.zeros(3), 4)
    with pytest.raises(ValueError, match="unknown selector"):
        selection.get_selector("nope")


@pytest.mark.parametrize("name", ["sampled", "sampled_torch_backend"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(200_000, 20), (300_000, 300), (1_000_000, 1000), (250_000, 5000)])
def test_sampling_path_is_exact_at_scale(name, dtype, n, k):
    gen = torch.Generator().manual_seed(k)
    check_exact(SELECTORS[name], torch.randn(n, generator=gen).to(dtype), k)
    # heavy ties at the threshold: few distinct magnitudes
    check_exact(SELECTORS[name], torch.randint(-4, 5, (n,), generator=gen).to(dtype), k)
    # a sparse gradient: mostly zeros, so the sampled threshold is 0
    x = torch.zeros(n, dtype=dtype)
    x[torch.randperm(n, generator=gen)[: 2 * k]] = torch.randn(2 * k, generator=gen).to(dtype)
    check_exact(SELECTORS[name], x, k)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_too_few_candidates_falls_back_to_full_search(monkeypatch, backend):
    ops = selection._NumpyOps if backend == "numpy" else selection._TorchOps
    # a sample of only the largest magnitude puts the threshold too high
    monkeypatch.setattr(
        ops,
        "sampled_magnitudes",
        staticmethod(
            lambda x, stride, offset: (
                ops.magnitude(x).max().reshape(1).repeat(64)
                if backend == "torch"
                else np.full(64, ops.magnitude(x).max())
            )
        ),
    )
    x = torch.randn(500_000, generator=torch.Generator().manual_seed(3))
    check_exact(functools.partial(selection.select_sampled, backend=backend), x, 100)


def test_non_contiguous_input():
    x = torch.randn(400_000, generator=torch.Generator().manual_seed(5))[::2]
    check_exact(selection.select_sampled, x, 50)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(4096, 60_000),
    distinct=st.integers(1, 50),
    k_fraction=st.floats(1e-4, 0.3),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_sampling_path(n, distinct, k_fraction, dtype, seed):
    """Large enough for the sampled threshold, with few distinct magnitudes (many ties)."""
    gen = torch.Generator().manual_seed(seed)
    levels = torch.randn(distinct, generator=gen)
    x = levels[torch.randint(distinct, (n,), generator=gen)].to(dtype)
    k = max(1, min(n, round(k_fraction * n)))
    for select in SELECTORS.values():
        check_exact(select, x, k)


@pytest.mark.parametrize("name", sorted(SELECTORS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("n,k", [(7, 1), (100, 3), (50_000, 50), (300_000, 30)])
def test_a_nonfinite_entry_is_always_selected(name, dtype, bad, n, k):
    """NaN counts as the largest magnitude, then +/-inf: one non-finite entry anywhere
    reaches the selected values, so the merge of every rank sees it (no finiteness pass)."""
    gen = torch.Generator().manual_seed(n + k)
    x = (100 * torch.randn(n, generator=gen)).to(dtype)
    position = int(torch.randint(n, (1,), generator=gen))
    x[position] = bad
    values, indices = SELECTORS[name](x, k)
    assert values.numel() == k and indices.unique().numel() == k
    assert position in indices.tolist() and not torch.isfinite(values).all()


def test_a_callable_selector_propagates_nonfinite_input():
    def first_k(x, k):
        return x[:k].clone(), torch.arange(k)

    select = selection.get_selector(first_k)
    x = torch.arange(10.0)
    assert torch.equal(select(x, 2)[0], torch.tensor([0.0, 1.0]))
    x[7] = float("inf")
    assert torch.isnan(select(x, 2)[0]).all()


@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.int64])
@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 200, 4097])
def test_compiled_candidate_search_matches_numpy(dtype, n):
    """``_kernels.find``: the positions whose sign-cleared key reaches the threshold,
    ascending, for every key width, across its chunk boundaries and with a padded tail."""
    gen = np.random.default_rng(n)
    info = np.iinfo(dtype)
    keys = gen.integers(info.min, info.max, size=n, dtype=dtype, endpoint=True)
    keys[::7] = 0  # zero magnitudes
    magnitudes = keys & dtype(info.max)
    for threshold in [0, 1, int(np.median(magnitudes)) if n else 5, int(info.max)]:
        expected = np.flatnonzero(magnitudes >= threshold)
        out = np.full(n + 1, -1, dtype=np.int64)
        count = _kernels.find(keys, keys.itemsize, threshold, out)
        assert count == expected.size
        np.testing.assert_array_equal(out[:count], expected)


def test_compiled_candidate_search_reports_overflow_and_bad_input():
    keys = np.arange(100, dtype=np.int32)
    keys[95] |= np.int32(-(2**31))  # a sign bit does not count
    out = np.zeros(3, dtype=np.int64)
    assert _kernels.find(keys, 4, 90, out) == 10  # all 10 counted, the first 3 written
    np.testing.assert_array_equal(out, [90, 91, 92])
    with pytest.raises(ValueError, match="threshold"):
        _kernels.find(keys, 4, -1, out)
    with pytest.raises(ValueError, match="threshold"):
        _kernels.find(keys.astype(np.int16), 2, 2**15, out)
    with pytest.raises(ValueError, match="whole"):
        _kernels.find(keys, 3, 1, out)
    with pytest.raises(ValueError, match="contiguous"):
        _kernels.find(keys[::2], 4, 1, out)
    with pytest.raises(TypeError):
        _kernels.find(keys, 4, 1, out.tobytes())  # read-only output


def test_candidate_positions_grow_past_the_scratch():
    """More candidates than the thread's scratch ever held: it grows and the search reruns."""
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(11))
    a = selection._NumpyOps.prepare(x)
    positions, magnitudes = selection._NumpyOps.candidates(a, 0)
    np.testing.assert_array_equal(positions, np.arange(x.numel()))
    np.testing.assert_array_equal(magnitudes, a & np.int32(2**31 - 1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(1, 1), (100, 3), (4097, 5), (50_000, 50), (300_000, 300), (250_000, 5000)])
def test_add_select_is_an_accumulate_then_the_exact_topk(dtype, n, k):
    """``add_select``: out = a + b, bit for bit as ``torch.add``, and the oracle's TopK of it
    (the compiled pass for float32/64 at sizes with a sampled threshold; else torch.add)."""
    gen = torch.Generator().manual_seed(n + k)
    a, b = torch.randn(n, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)
    out = torch.full((n,), float("nan"), dtype=dtype)
    values, indices = selection.add_select(out, a, b, k)
    assert torch.equal(out, b + a)
    np.testing.assert_array_equal(indices.numpy(), topk_indices(out.float().numpy(), k))
    assert torch.equal(values, out[indices])


@pytest.mark.parametrize("case", ["sparse", "ties", "nonfinite", "strided"])
def test_add_select_special_inputs(case):
    n, k = 200_000, 40
    gen = torch.Generator().manual_seed(7)
    a, b = torch.zeros(n), torch.zeros(n)
    if case == "sparse":  # mostly zero sums: the sampled threshold is 0
        b[torch.randperm(n, generator=gen)[: 3 * k]] = torch.randn(3 * k, generator=gen)
    elif case == "ties":
        a, b = torch.randint(-2, 3, (n,), generator=gen).float(), torch.randint(-2, 3, (n,), generator=gen).float()
    elif case == "nonfinite":
        a, b = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        b[12_345] = float("inf")
        a[12_345] = -float("inf")  # inf + -inf = NaN, selected first
    else:  # not contiguous: the torch.add path
        a, b = torch.randn(2 * n, generator=gen)[::2], torch.randn(n, generator=gen)
    out = torch.empty(n)
    values, indices = selection.add_select(out, a, b, k)
    expected = b + a
    assert torch.equal(out, expected) or (case == "nonfinite" and torch.equal(out.nan_to_num(), expected.nan_to_num()))
    ranked = out.nan_to_num(nan=float("inf"))  # the oracle ranks by abs(); a NaN ranks above all
    np.testing.assert_array_equal(indices.numpy(), topk_indices(ranked.numpy(), k))
    if case == "nonfinite":
        assert 12_345 in indices.tolist() and values.isnan().any()


def test_add_select_falls_back_when_too_few_candidates(monkeypatch):
    """A sampled threshold that lets fewer than k entries through: the full search, still exact."""
    monkeypatch.setattr(
        selection._NumpyOps,
        "magnitude",
        classmethod(
            lambda cls, source: (
                np.full(64, np.iinfo(source.dtype).max, dtype=source.dtype)
                if source.size < 10_000
                else cls._keys(source)
            )
        ),
    )
    gen = torch.Generator().manual_seed(9)
    a, b, out = torch.randn(500_000, generator=gen), torch.randn(500_000, generator=gen), torch.empty(500_000)
    values, indices = selection.add_select(out, a, b, 100)
    np.testing.assert_array_equal(indices.numpy(), topk_indices(out.numpy(), 100))


def test_compiled_add_find_and_add_sample_against_numpy():
    """``add_find`` over parts: the sum written and the positions found as ``find`` finds
    them in it; ``add_sample``: the magnitudes of the sum every stride-th entry."""
    gen = np.random.default_rng(0)
    for dtype, keys in ((np.float32, np.int32), (np.float64, np.int64)):
        a = gen.standard_normal(1000).astype(dtype)
        parts = [gen.standard_normal(size).astype(dtype) for size in (10, 0, 63, 927)]
        total, out = np.empty(1000, dtype), np.empty(1001, np.int64)
        magnitudes = (a + np.concatenate(parts)).view(keys) & np.iinfo(keys).max
        threshold = int(np.sort(magnitudes)[-50])
        count = _kernels.add_find(a, parts, total, a.itemsize, threshold, out)
        np.testing.assert_array_equal(total, a + np.concatenate(parts))
        np.testing.assert_array_equal(out[:count], np.flatnonzero(magnitudes >= threshold))
        sample = np.empty(1000 // 7 + 1, keys)
        m = _kernels.add_sample(a, parts, a.itemsize, 7, 3, sample)
        np.testing.assert_array_equal(sample[:m], magnitudes[3::7])


@pytest.mark.parametrize("dtype,keys", [(np.float32, np.int32), (np.float64, np.int64)])
def test_compiled_add_find_streams_a_large_total_at_any_alignment(dtype, keys):
    """A total of 1 MiB or more is streamed from its first cache line on: the sum and the
    positions are the same wherever the total starts (every element offset within a
    line, and a byte offset that is not whole elements) and wherever the parts split."""
    gen = np.random.default_rng(1)
    n = (1 << 20) // np.dtype(dtype).itemsize + 333
    a = gen.standard_normal(n).astype(dtype)
    b = gen.standard_normal(n).astype(dtype)
    parts = [b[:1], b[1:100_003], b[100_003:100_010], b[100_010:]]
    magnitudes = (a + b).view(keys) & np.iinfo(keys).max
    threshold = int(np.sort(magnitudes)[-500])
    expected = np.flatnonzero(magnitudes >= threshold)
    itemsize = np.dtype(dtype).itemsize
    room = np.zeros((n + 64 // itemsize + 1) * itemsize + 64, np.uint8)
    base = (-room.ctypes.data) % 64  # room[base:] starts on a cache line
    offsets = [base + i * itemsize for i in range(64 // itemsize)] + [base + 2]
    for offset in offsets:
        total = room[offset : offset + n * itemsize].view(dtype)
        out = np.empty(len(expected) + 1, np.int64)
        count = _kernels.add_find(a, parts, total, itemsize, threshold, out)
        np.testing.assert_array_equal(total, a + b)
        np.testing.assert_array_equal(out[:count], expected)


def test_compiled_add_find_rejects_mismatched_buffers():
    a, b, out = np.zeros(10, np.float32), np.zeros(10, np.float32), np.zeros(4, np.int64)
    with pytest.raises(ValueError, match="must be the same size"):
        _kernels.add_find(a, [b[:9]], np.zeros(10, np.float32), 4, 0, out)
    with pytest.raises(ValueError, match="same whole"):
        _kernels.add_find(a.view(np.int16), [b.view(np.int16)], np.zeros(20, np.int16), 2, 0, out)
    with pytest.raises(ValueError, match="threshold"):
        _kernels.add_find(a, [b], np.zeros(10, np.float32), 4, 2**31, out)
    with pytest.raises(ValueError, match="not whole"):
        _kernels.add_find(a, [b.view(np.uint8)[:3], b], np.zeros(10, np.float32), 4, 0, out)
    with pytest.raises(TypeError, match="sequence"):
        _kernels.add_find(a, 5, np.zeros(10, np.float32), 4, 0, out)
    for stride, offset in ((0, 0), (4, 4), (2**63 - 1, -1)):  # offset in [0, stride)
        with pytest.raises(ValueError, match="offset < stride"):
            _kernels.add_sample(a, [b], 4, stride, offset, np.zeros(4, np.int32))
    sample = np.zeros(4, np.int32)
    assert _kernels.add_sample(a, [b], 4, 2**63 - 1, 3, sample) == 1  # a stride past the end: one entry
    shared = np.zeros(20, np.float32)
    with pytest.raises(ValueError, match="overlap"):
        _kernels.add_find(shared[10:], [b], shared[1:11], 4, 0, out)  # total over a
    with pytest.raises(ValueError, match="overlap"):
        _kernels.add_find(a, [shared[:10]], shared[5:15], 4, 0, out)  # total over a part
    assert _kernels.add_find(shared[:10], [shared[:10]], np.zeros(10, np.float32), 4, 1, out) == 0  # inputs may share


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes", [(70_000, 1, 0, 130_000), (64,) * 3000 + (5000,), (250_000,)])
def test_add_select_over_a_buckets_parts(dtype, sizes):
    """``b`` given as the parts of a bucket (its members' gradients, end to end, one of
    them empty): the same sum and TopK as of their concatenation."""
    n = sum(sizes)
    k = max(1, n // 500)
    gen = torch.Generator().manual_seed(len(sizes))
    a = torch.randn(n, generator=gen).to(dtype)
    parts = [torch.randn(size, generator=gen).to(dtype) for size in sizes]
    out = torch.empty(n, dtype=dtype)
    values, indices = selection.add_select(out, a, parts, k)
    assert torch.equal(out, torch.cat(parts) + a)
    np.testing.assert_array_equal(indices.numpy(), topk_indices(out.float().numpy(), k))
    assert torch.equal(values, out[indices])


def test_add_select_parts_that_overflow_the_scratch_or_do_not_fit():
    """Candidates past the positions scratch, spread over parts: the search is redone over
    the whole sum, still exact; parts that do not make up ``out`` are refused."""
    gen = torch.Generator().manual_seed(4)
    a = torch.zeros(300_000)
    parts = [torch.randn(100_000, generator=gen) for _ in range(3)]
    parts[1][::2] = 0
    out = torch.empty(300_000)
    selection._NumpyOps._local.__dict__.setdefault("scratch", {})["positions"] = np.empty(
        16, dtype=np.int64
    )  # too short
    values, indices = selection.add_select(out, a, parts, 30_000)
    np.testing.assert_array_equal(indices.numpy(), topk_indices(out.numpy(), 30_000))
    with pytest.raises(ValueError, match="parts of"):
        selection.add_select(out, a, parts[:2], 10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_select_regions_is_every_regions_exact_top_k_in_one_pass(dtype):
    """``select_regions`` (the compiled one-pass regional selection) against the numpy oracle,
    region by region: ties to the lowest index, NaN and -inf first, empty regions and shares
    of 0, up to every entry, and 256 regions."""
    rng = np.random.default_rng(7)
    for trial in range(300):
        n = int(rng.integers(1, 2000))
        parts = int(rng.integers(1, 257 if trial % 3 == 0 else 12))
        boundaries = [0, *sorted(int(b) for b in rng.integers(0, n + 1, parts - 1)), n]
        x = rng.standard_normal(n)
        if trial % 2:
            x = np.round(x * 2) / 2  # many ties
        x = torch.from_numpy(x).to(dtype)
        if trial % 5 == 0:
            x[int(rng.integers(n))] = float("nan")
            x[int(rng.integers(n))] = float("-inf")
        shares = [int(rng.integers(0, hi - lo + 1)) if hi > lo else 0 for lo, hi in zip(boundaries, boundaries[1:])]
        values, indices = selection.select_regions(x, boundaries, shares)
        keys = np.abs(x.double().numpy())  # NaN above inf above every finite magnitude, as selectors order them
        keys = np.where(np.isnan(keys), 1.7e308, np.where(np.isinf(keys), 1.5e308, keys))
        want = [lo + topk_indices(keys[lo:hi], k) for lo, hi, k in zip(boundaries, boundaries[1:], shares) if k]
        want = np.concatenate(want) if want else np.zeros(0, dtype=np.int64)
        assert indices.tolist() == want.tolist(), trial
        assert torch.equal(values.view(-1).double().nan_to_num(7.0), x[indices].double().nan_to_num(7.0))
