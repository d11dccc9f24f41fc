"""Selection against the numpy oracle: exact index sets, deterministic ties."""
import functools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lags_hvd import selection
from oracle import topk_indices

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def check_exact(select, x: torch.Tensor, k: int):
    values, indices = select(x, k)
    expected = topk_indices(x.float().numpy(), k)
    assert indices.dtype == torch.int64
    np.testing.assert_array_equal(indices.numpy(), expected)
    assert torch.equal(values, x[indices])


SELECTORS = dict(selection.SELECTORS, sampled_torch_backend=functools.partial(
    selection.select_sampled, backend="torch"))


@pytest.mark.parametrize("name", sorted(SELECTORS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(1, 1), (7, 1), (7, 7), (100, 3), (1000, 10), (4096, 4095), (50_000, 50)])
def test_matches_oracle_on_random_tensors(name, dtype, n, k):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n * 31 + k)).to(dtype)
    check_exact(SELECTORS[name], x, k)


@pytest.mark.parametrize("name", sorted(SELECTORS))
@pytest.mark.parametrize("x,k", [
    (torch.zeros(10), 3),                                        # all zero
    (torch.ones(10), 4),                                         # all equal
    (torch.tensor([1.0, -1.0, 1.0, -1.0, 0.5]), 3),              # signed ties
    (torch.tensor([0.0, float("inf"), 1.0, float("-inf")]), 2),  # +/- inf
    (torch.tensor([2.0, 0.0, 0.0, 2.0, 1.0, 2.0]), 2),           # ties at the k-th value
])
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
    monkeypatch.setattr(ops, "sampled_magnitudes", staticmethod(
        lambda x, stride, offset: ops.magnitude(x).max().reshape(1).repeat(64) if backend == "torch"
        else np.full(64, ops.magnitude(x).max())))
    x = torch.randn(500_000, generator=torch.Generator().manual_seed(3))
    check_exact(functools.partial(selection.select_sampled, backend=backend), x, 100)


def test_non_contiguous_input():
    x = torch.randn(400_000, generator=torch.Generator().manual_seed(5))[::2]
    check_exact(selection.select_sampled, x, 50)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(4096, 60_000), distinct=st.integers(1, 50), k_fraction=st.floats(1e-4, 0.3),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
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
