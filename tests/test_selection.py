"""Selection against the numpy oracle: exact index sets, deterministic ties."""
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


@pytest.mark.parametrize("name", sorted(selection.SELECTORS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(1, 1), (7, 1), (7, 7), (100, 3), (1000, 10), (4096, 4095), (50_000, 50)])
def test_matches_oracle_on_random_tensors(name, dtype, n, k):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n * 31 + k)).to(dtype)
    check_exact(selection.SELECTORS[name], x, k)


@pytest.mark.parametrize("name", sorted(selection.SELECTORS))
@pytest.mark.parametrize("x,k", [
    (torch.zeros(10), 3),                                        # all zero
    (torch.ones(10), 4),                                         # all equal
    (torch.tensor([1.0, -1.0, 1.0, -1.0, 0.5]), 3),              # signed ties
    (torch.tensor([0.0, float("inf"), 1.0, float("-inf")]), 2),  # +/- inf
    (torch.tensor([2.0, 0.0, 0.0, 2.0, 1.0, 2.0]), 2),           # ties at the k-th value
])
def test_ties_and_special_values(name, x, k):
    check_exact(selection.SELECTORS[name], x, k)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-3, 3), min_size=1, max_size=300), st.data())
def test_property_heavy_ties(ints, data):
    x = torch.tensor(ints, dtype=torch.float32)
    k = data.draw(st.integers(1, len(ints)))
    for select in selection.SELECTORS.values():
        check_exact(select, x, k)


def test_k_for_density():
    assert selection.k_for_density(0.001, 10) == 1
    assert selection.k_for_density(0.001, 10_000) == 10
    assert selection.k_for_density(0.0011, 10_000) == 11
    assert selection.k_for_density(1.0, 17) == 17
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="density"):
            selection.k_for_density(bad, 10)


def test_bad_arguments():
    with pytest.raises(ValueError, match="1-D"):
        selection.select_topk(torch.zeros(2, 2), 1)
    with pytest.raises(ValueError, match="k must be"):
        selection.select_topk(torch.zeros(3), 4)
    with pytest.raises(ValueError, match="unknown selector"):
        selection.get_selector("nope")
